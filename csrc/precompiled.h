// The torch headers the op library's sources include, parsed once per build: with GCC, setup.py
// compiles this header to a precompiled header and force-includes it (-include) into every C++
// source of revkernels._C, so each file loads the parsed state instead of parsing these headers
// (ATen, autograd, the dispatcher) on its own. Other compilers compile as without it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>
