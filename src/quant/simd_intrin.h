#pragma once
// <immintrin.h> for the SIMD translation units. GCC 12's AVX-512 headers trip
// -Wuninitialized/-Wmaybe-uninitialized on their own `__Y = __Y` "undefined vector" idiom
// (GCC PR105593); the warning is located inside the header, so silencing it here, around the
// include, keeps the check on for our code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
