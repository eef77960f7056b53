/* bfloat16 <-> float32 for the C kernels (linear.c, layers.c, paged_decode.c): a bf16 is
 * the top half of a float32. Included by each source; the libraries' names hash it too
 * (gpu_worker/cpu/build.py, KernelLibrary's includes). */
#ifndef SHUTTLE_BF16_H
#define SHUTTLE_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float32 to bfloat16, rounded to nearest even, NaN kept (torch's conversion) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#endif
