/* A C check of kernels/cpu/quant.c's quant_matmul_f32 at whatever ISA level it is compiled
 * for (scripts/check_arm_kernels.sh builds it at every aarch64 level under qemu and at the x86
 * levels natively; tests/kernels/test_quant_check_c.py at the x86 levels this CPU runs).
 *
 * Random rows of each GGUF block type (random bytes, fp16 scales of either sign and magnitude
 * 2^-12..2^-9, as tests/kernels/test_quant_cpu.py draws them), y = x @ W^T for T = 1, 3, 8, 70
 * and both methods, against a float64 dequantize + matmul written here from the GGUF layouts
 * (engine/models/gguf_quants.py), with the Python tests' tolerances:
 *   fp32 (method 1): |y - ref| <= 1e-5 (|x| @ |W|^T);
 *   int8 (method 0): within 1e-5 (|x_q| @ |W|^T) of x_q @ W^T, x_q being x rounded as the
 *   kernel rounds it (per 32 values to steps of max|x| / 127, in fp32), and within
 *   (step / 2) @ |W|^T + 1e-5 (|x| @ |W|^T) of x @ W^T.
 * Rows are strided, with NaN in the gaps, so a read past a row of x shows in y, and a write
 * past a row of y shows in the gap. Prints one line per failure and a summary; exits 1 on any
 * failure.
 *
 * Build: cc -O3 -fopenmp -std=gnu11 LEVEL_FLAGS -Ikernels/cpu tests/kernels_c/quant_check.c
 *        kernels/cpu/quant.c -lm */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, NTYPES }; /* kernels/cpu/quant.py's codes */
static const char *NAMES[NTYPES] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
static const int VALUES[NTYPES] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int BYTES[NTYPES] = {18, 20, 22, 24, 34, 144, 176, 210};
/* Where each type's fp16 fields start (a second -1: one field). */
static const int FP16_AT[NTYPES][2] = {{0, -1}, {0, 2}, {0, -1}, {0, 2}, {0, -1}, {0, 2}, {0, 2}, {208, -1}};

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static uint64_t next_u64(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Du;
}
static double uniform(void) { return (double)(next_u64() >> 11) / 9007199254740992.0; }
static float normalish(void) { /* sum of four uniforms, centred: enough spread for a check */
    return (float)((uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7);
}

static double half_value(const uint8_t *p) {
    const int h = p[0] | p[1] << 8, e = (h >> 10) & 31, m = h & 1023;
    const double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return h >> 15 ? -v : v;
}

static void fill_blocks(int type, uint8_t *w, int64_t nblocks) {
    for (int64_t i = 0; i < nblocks * BYTES[type]; i++) w[i] = (uint8_t)next_u64();
    for (int64_t b = 0; b < nblocks; b++)
        for (int f = 0; f < 2; f++) {
            if (FP16_AT[type][f] < 0) continue;
            /* sign | exponent 2^-12..2^-10 | random mantissa: magnitude 2^-12 .. 2^-9 */
            const int bits = (int)(next_u64() & 1) << 15 | (int)(3 + next_u64() % 3) << 10 | (int)(next_u64() & 1023);
            uint8_t *p = w + b * BYTES[type] + FP16_AT[type][f];
            p[0] = (uint8_t)bits, p[1] = (uint8_t)(bits >> 8);
        }
}

/* One block at p -> its values, exactly (every value fits a double). */
static void dequant_block(int type, const uint8_t *p, double *out) {
    const double d = half_value(p);
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
        const int qs = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        const uint32_t qh = type == Q5_0 || type == Q5_1 ? (uint32_t)p[qs - 4] | (uint32_t)p[qs - 3] << 8 |
                                                               (uint32_t)p[qs - 2] << 16 | (uint32_t)p[qs - 1] << 24 : 0;
        const double min = type == Q4_1 || type == Q5_1 ? half_value(p + 2) : 0.0;
        const int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
        for (int j = 0; j < 16; j++) {
            const int q0 = (p[qs + j] & 15) | (int)((qh >> j) & 1) << 4, q1 = (p[qs + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            out[j] = d * (q0 - offset) + min, out[j + 16] = d * (q1 - offset) + min;
        }
        break;
    }
    case Q8_0:
        for (int j = 0; j < 32; j++) out[j] = d * (int8_t)p[2 + j];
        break;
    case Q4_K: case Q5_K: {
        const double dmin = half_value(p + 2);
        const uint8_t *s = p + 4, *qs = p + (type == Q5_K ? 48 : 16), *qh = p + 16;
        int sc[8], mn[8];
        for (int i = 0; i < 4; i++) {
            sc[i] = s[i] & 63, mn[i] = s[i + 4] & 63;
            sc[i + 4] = (s[i + 8] & 15) | (s[i] >> 6) << 4, mn[i + 4] = (s[i + 8] >> 4) | (s[i + 4] >> 6) << 4;
        }
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
                if (type == Q5_K) lo |= ((qh[l] >> (2 * j)) & 1) << 4, hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                out[64 * j + l] = d * sc[2 * j] * lo - dmin * mn[2 * j];
                out[64 * j + 32 + l] = d * sc[2 * j + 1] * hi - dmin * mn[2 * j + 1];
            }
        break;
    }
    default: { /* Q6_K: value 128 n + 32 f + b: low 4 bits from ql, bits 2 f of qh[32 n + b] */
        const double d6 = half_value(p + 208);
        for (int v = 0; v < 256; v++) {
            const int n = v / 128, f = v % 128 / 32, b = v % 32;
            const int low = f < 2 ? p[64 * n + 32 * f + b] & 15 : p[64 * n + 32 * (f - 2) + b] >> 4;
            const int q = low | ((p[128 + 32 * n + b] >> (2 * f)) & 3) << 4;
            out[v] = d6 * (int8_t)p[192 + v / 16] * (q - 32);
        }
    }
    }
}

/* x as the int8 path rounds it: per 32 values, steps of max|x| / 127 (in fp32, as quant.c). */
static void int8_rounded(const float *x, int64_t K, float *xq, float *step) {
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[k0 + i]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f, dx = amax / 127.0f;
        for (int i = 0; i < 32; i++) {
            const float r = x[k0 + i] * id;
            xq[k0 + i] = __builtin_roundevenf(r) * dx, step[k0 + i] = dx;
        }
    }
}

static int cases, failures;

static void fail(const char *what, int type, int64_t N, int64_t K, int64_t T, int method, double err) {
    failures++;
    printf("FAIL %s %s N=%lld K=%lld T=%lld method=%s: %.3e\n", what, NAMES[type], (long long)N, (long long)K,
           (long long)T, method ? "fp32" : "int8", err);
}

/* One product: x [T, K] (scaled by `scale`, rows K + 3 apart) times W [N, K] of `type`. */
static void check(int type, int64_t N, int64_t K, int64_t T, int method, const uint8_t *w, const double *W, float scale,
                  int spread) {
    const int64_t xs = K + 3, ys = N + 2;
    float *x = malloc(sizeof(float) * (size_t)(T * xs)), *y = malloc(sizeof(float) * (size_t)(T * ys));
    float *xq = malloc(sizeof(float) * (size_t)K), *step = malloc(sizeof(float) * (size_t)K);
    for (int64_t i = 0; i < T * xs; i++) x[i] = i % xs < K ? normalish() * scale : NAN;
    if (spread)
        for (int64_t i = 0; i < T * xs; i++) x[i] *= i % xs < K ? powf(10.0f, (float)(uniform() * 50 - 25)) : 1.0f;
    for (int64_t i = 0; i < T * ys; i++) y[i] = NAN;
    quant_matmul_f32(x, xs, w, N, K / VALUES[type] * BYTES[type], type, K, y, ys, T, method, 2);
    cases++;
    double worst = 0.0, worst_bound = 0.0;
    int bad_gap = 0;
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * xs;
        if (method == 0) int8_rounded(xr, K, xq, step);
        for (int64_t n = 0; n < N; n++) {
            double ref = 0, mag = 0, emul = 0, qmag = 0, reach = 0;
            for (int64_t k = 0; k < K; k++) {
                const double wv = W[n * K + k];
                ref += xr[k] * wv, mag += fabs(xr[k] * wv);
                if (method == 0) emul += xq[k] * wv, qmag += fabs(xq[k] * wv), reach += step[k] / 2.0 * fabs(wv);
            }
            const double got = y[t * ys + n];
            if (!isfinite(got)) { worst = INFINITY; continue; }
            if (method == 1) {
                const double err = fabs(got - ref) / (mag + 1e-300);
                if (fabs(got - ref) > 1e-5 * mag && err > worst) worst = err;
            } else {
                const double err = fabs(got - emul) / (qmag + 1e-300);
                if (fabs(got - emul) > 1e-5 * qmag * 1.001 && err > worst) worst = err;
                if (fabs(got - ref) > reach * 1.001 + 1e-5 * mag) worst_bound = fabs(got - ref) / (reach + 1e-300);
            }
        }
        for (int64_t n = N; n < ys; n++) bad_gap |= !isnan(y[t * ys + n]);
    }
    if (worst > 0) fail(method ? "off x@W^T by (of |x|@|W|^T)" : "off x_q@W^T by (of |x_q|@|W|^T)", type, N, K, T, method, worst);
    if (worst_bound > 0) fail("beyond the rounding bound by (of the bound)", type, N, K, T, method, worst_bound);
    if (bad_gap) fail("wrote past a row of y", type, N, K, T, method, 0.0);
    free(x), free(y), free(xq), free(step);
}

int main(int argc, char **argv) {
    const char *level = argc > 1 ? argv[1] : "?";
    for (int type = 0; type < NTYPES; type++) {
        /* a short last chunk for the 32-value types (608 = 2 chunks + 3 blocks), a row of less
         * than one chunk, and enough rows to split between two threads */
        const int64_t shapes[3][2] = {{37, VALUES[type] == 32 ? 608 : 768}, {100, 1024}, {5, VALUES[type] == 32 ? 96 : 256}};
        for (int s = 0; s < 3; s++) {
            const int64_t N = shapes[s][0], K = shapes[s][1], nblocks = N * K / VALUES[type];
            uint8_t *w = malloc((size_t)(nblocks * BYTES[type]));
            double *W = malloc(sizeof(double) * (size_t)(N * K));
            fill_blocks(type, w, nblocks);
            for (int64_t b = 0; b < nblocks; b++) dequant_block(type, w + b * BYTES[type], W + b * VALUES[type]);
            const int64_t Ts[4] = {1, 3, 8, 70};
            for (int i = 0; i < (s == 0 ? 4 : 3); i++)
                for (int method = 0; method < 2; method++) check(type, N, K, Ts[i], method, w, W, 1.0f, 0);
            /* the exact method at T = 1 for activations of any magnitude (quant_t1*.h and
             * quant_neon_t1.h scale the row by a power of two) */
            const float scales[3] = {1e-36f, 1e30f, 0.0f};
            for (int i = 0; i < 3; i++) check(type, N, K, 1, 1, w, W, scales[i], 0);
            check(type, N, K, 1, 1, w, W, 1.0f, 1);
            free(w), free(W);
        }
    }
    printf("quant_check %s: %d cases, %d failed\n", level, cases, failures);
    return failures != 0;
}
