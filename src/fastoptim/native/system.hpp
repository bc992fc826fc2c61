// The system headers of the CPU kernels, apart from the rest so that native.load can precompile them once per
// machine (parsing <immintrin.h> is most of a small kernel's build). Included (inlined by native.assemble) by
// common.hpp; a build that has its precompiled form sees them first, and the inlined copy is then a no-op.
#ifndef FO_SYSTEM_HPP
#define FO_SYSTEM_HPP
#include <atomic>
#include <cstdint>
#include <cstring>
#include <cmath>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#endif  // FO_SYSTEM_HPP
