"""Launch-configuration sweep of the Triton LayerNorm and bias+GELU kernels (CUDA only).

    python benchmarks/sweep_triton_configs.py > sweep.txt

Times the kernels themselves (no op wrapper: no argument checks, allocation or dispatch), bf16, with
triton.testing.do_bench medians, over warp counts, programs per SM, tile shapes and partial-sum
row counts, at the fused ops' benchmark widths. The launch configurations the modules use
(revkernels/triton/layer_norm.py, bias_gelu.py) were chosen from its output on an H200
(benchmarks/results/h200_triton_config_sweep.txt); rerun it on another GPU before retuning.
GB/s counts the bytes each op must move (as benchmarks/bench_kernels.py does); the device's copy
bandwidth is printed first.
"""
import sys

import torch


def main():
    if not torch.cuda.is_available():
        print("sweep_triton_configs.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    import revkernels.triton.bias_gelu as B
    import revkernels.triton.layer_norm as L

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def median_ms(fn):
        return do_bench(fn, warmup=25, rep=60, return_mode="median")

    def rand(*shape):
        return torch.randn(*shape, device=dev).to(bf)

    src = rand(32768, 4096)
    dst = torch.empty_like(src)
    print("copy GB/s", 2 * src.numel() * 2 / (median_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9)
    for rows, n in [(12608, 768), (25216, 1024), (32768, 4096)]:
        act = rows * n * 2
        y, g, dln, dres = (rand(rows, n) for _ in range(4))
        w, b = rand(n), rand(n)
        x, ln, dx = torch.empty_like(y), torch.empty_like(y), torch.empty_like(y)
        mean, rstd = torch.randn(rows, device=dev), torch.rand(rows, device=dev) + 0.5
        block_n = triton.next_power_of_2(n)
        for warps in (2, 4, 8, 16, 32):
            ms = median_ms(lambda: L._sub_layer_norm_fwd_kernel[(rows,)](
                x, ln, mean, rstd, y, n, g, n, w, b, 1e-6, n, ACC_FP64=False, BLOCK_N=block_n, num_warps=warps))
            print(f"ln_fwd {rows}x{n} warps {warps:2d}: {ms * 1e3:7.1f} us {4 * act / (ms * 1e-3) / 1e9:6.0f} GB/s")
        for per_sm in (1, 2, 4, 8):
            for warps in (4, 8, 16):
                rows_per_program = triton.cdiv(rows, min(rows, per_sm * sms))
                programs = triton.cdiv(rows, rows_per_program)
                partial = torch.empty(2, programs, n, device=dev)

                def run():
                    L._layer_norm_bwd_add_kernel[(programs,)](
                        dx, partial[0], partial[1], dln, n, y, n, w, mean, rstd, dres, n, n, rows, rows_per_program,
                        ACC_FP64=False, BLOCK_N=block_n, num_warps=warps)
                    L._sum_partials_kernel[(triton.cdiv(n, L.PARTIAL_BLOCK_N), 2)](
                        w, b, partial, programs, n, BLOCK_P=L.PARTIAL_BLOCK_P, BLOCK_N=L.PARTIAL_BLOCK_N)

                ms = median_ms(run)
                print(f"ln_bwd {rows}x{n} per_sm {per_sm} warps {warps:2d}: {ms * 1e3:7.1f} us "
                      f"{4 * act / (ms * 1e-3) / 1e9:6.0f} GB/s")
    for rows, n in [(12608, 3072), (32768, 4096)]:
        act = rows * n * 2
        h, dy, bias = rand(rows, n), rand(rows, n), rand(n)
        out = torch.empty_like(h)
        for tile in (2048, 4096, 8192):
            for block_n in (128, 256, 512):
                block_m = max(1, tile // block_n)
                for warps in (4, 8):
                    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
                    ms = median_ms(lambda: B._bias_gelu_kernel[grid](out, h, bias, rows, n, n, TANH=False, ACC_FP64=False,
                                                                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))
                    print(f"gelu_fwd {rows}x{n} tile {tile} bn {block_n} warps {warps}: {ms * 1e3:7.1f} us "
                          f"{2 * act / (ms * 1e-3) / 1e9:6.0f} GB/s")
                    for max_programs in (256, 1024):
                        chunks = min(triton.cdiv(rows, block_m), max_programs)
                        rows_per_program = triton.cdiv(triton.cdiv(rows, chunks), block_m) * block_m
                        chunks = triton.cdiv(rows, rows_per_program)
                        partial = torch.empty(chunks, n, device=dev)
                        dbias = torch.empty(n, device=dev, dtype=bf)

                        def run():
                            B._bias_gelu_bwd_kernel[(chunks, triton.cdiv(n, block_n))](
                                out, partial, dy, h, bias, rows, n, n, n, rows_per_program, TANH=False, ACC_FP64=False,
                                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
                            B._reduce_partials_kernel[(triton.cdiv(n, B.REDUCE_BLOCK),)](
                                dbias, partial, chunks, n, ACC_FP64=False, BLOCK=B.REDUCE_BLOCK)

                        ms = median_ms(run)
                        print(f"gelu_bwd {rows}x{n} tile {tile} bn {block_n} warps {warps} maxp {max_programs}: "
                              f"{ms * 1e3:7.1f} us {3 * act / (ms * 1e-3) / 1e9:6.0f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
