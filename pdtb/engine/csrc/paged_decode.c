/* Decode attention straight over the paged KV pool, float32, one query token per row.
 *
 * Built at first use by pdtb/engine/cpu_kernel.py (cc -O3 -march=native, no other
 * dependency) and called through ctypes, one call per layer for all decode rows of a step.
 * It replaces, on the CPU, the gather of each row's pages into a padded batch (or the read
 * cache that keeps such a batch between steps) followed by batched matmuls over the padding:
 * each row reads exactly its own keys from its own pages, whatever the other rows' lengths.
 *
 *   pool (one layer, K or V)  [num_pages * page_size slots, kv_heads, head_dim]
 *   key t of row b            slot = pages[page_start[b] + t / page_size] * page_size + t % page_size
 *   query head h              reads kv head h / (heads / kv_heads)   (GQA, as transformers' repeat_kv)
 *
 *   out[b, h] = sum_t softmax_t(scale * q[b, h] . K[t, h / g]) V[t, h / g],  t in [0, lens[b])
 *
 * Scores are kept for the whole row (scratch: heads * max(lens) floats), then one pass of
 * exponentials and one pass over V. No masks, no padding. exp is a Cephes-style polynomial
 * (about 1 ulp in float32), written so that the compiler vectorises it. Vectors are the CPU's
 * own width (W lanes: 16 with AVX-512, 8 with AVX, else 4).
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }  /* built without OpenMP: one thread */
#endif

/* W: the lanes of this CPU's widest float vector, so every vector operation below is one
 * instruction (a vector twice the hardware's width makes the compiler scalarise shuffles). */
#if defined(__AVX512F__)
#define W 16
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif
typedef float vf __attribute__((vector_size(4 * W), aligned(4)));  /* unaligned loads allowed */
typedef int32_t vi __attribute__((vector_size(4 * W)));
#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < W; i++) s += x[i];
    return s;
}

/* exp(x) for x <= 0 (a score minus its row's maximum), W lanes: Cephes' expf polynomial
 * (about 1 ulp in float32). n = round(x / ln 2) by the 1.5 * 2^23 trick, r = x - n ln 2 in two
 * parts, 2^n built in the exponent bits. Below -87 the weight is 0 in float32 anyway. */
INLINE vf expw(vf x) {
    const vf lo = (vf){0} - 87.0f;
    const vi below = x < lo;  /* lanes all ones where true */
    x = (vf)(((vi)x & ~below) | ((vi)lo & below));
    const vf magic = (vf){0} + 12582912.0f;
    vf n = (x * 1.44269504088896341f + magic) - magic;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    vf y = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

/* Softmax of each head's scores in place: scratch[h * len + t] becomes the weight. The
 * scratch is padded to a multiple of 16 floats per head (`stride`, a multiple of W); lanes
 * past `len` are computed on -inf-free filler and never read. */
static void softmax_rows(float *scratch, int64_t heads, int64_t len, int64_t stride) {
    for (int64_t h = 0; h < heads; h++) {
        float *s = scratch + h * stride;
        for (int64_t t = len; t < stride; t++) s[t] = s[0];  /* filler that cannot raise the max */
        vf mv = *(vf *)s;
        for (int64_t t = W; t < stride; t += W) {
            const vf x = *(vf *)(s + t);
            const vi gt = x > mv;
            mv = (vf)(((vi)x & gt) | ((vi)mv & ~gt));
        }
        float m = mv[0];
        for (int i = 1; i < W; i++) m = mv[i] > m ? mv[i] : m;
        for (int64_t t = len; t < stride; t++) s[t] = m - 1000.0f;  /* weight 0 */
        vf sum = (vf){0};
        for (int64_t t = 0; t < stride; t += W) {
            vf e = expw(*(vf *)(s + t) - m);
            *(vf *)(s + t) = e;
            sum += e;
        }
        const float inv = 1.0f / hsum(sum);
        for (int64_t t = 0; t < stride; t += W) *(vf *)(s + t) *= inv;
    }
}

/* The horizontal sums of W vectors at once, as one vector: lane i = sum of a[i]'s lanes.
 * log2(W) rounds of pairwise folds instead of W separate reductions of about log2(W) dependent
 * steps each. Each fold's shuffle is one instruction of its width: within 128-bit lanes
 * (shufps) in the first rounds, across them (vperm2f128, vshuff32x4) in the last. */
#define FOLD(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
#if W == 16
INLINE vf hsum_w(const vf *a) {
    vf c[8], e[4], f[2];
    for (int i = 0; i < 8; i++)  /* c[i]: keys 2i, 2i+1, 8 partial sums each */
        c[i] = FOLD(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + FOLD(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)  /* e[i]: keys 4i .. 4i+3, 4 partial sums each */
        e[i] = FOLD(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + FOLD(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)  /* f[i]: keys 8i .. 8i+7, 2 partial sums each */
        f[i] = FOLD(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + FOLD(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return FOLD(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + FOLD(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#elif W == 8
/* Two rounds of pair sums within each 128-bit lane (hadd's pattern), then the two lanes added:
 * u[j]'s low lane holds keys 4j..4j+3 summed over elements 0-3, its high lane over 4-7. */
#define PAIRS(x, y) (FOLD(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + FOLD(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
INLINE vf hsum_w(const vf *a) {
    const vf t0 = PAIRS(a[0], a[1]), t1 = PAIRS(a[2], a[3]), t2 = PAIRS(a[4], a[5]), t3 = PAIRS(a[6], a[7]);
    const vf u0 = PAIRS(t0, t1), u1 = PAIRS(t2, t3);
    return FOLD(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + FOLD(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
INLINE vf hsum_w(const vf *a) {
    const vf t0 = FOLD(a[0], a[1], 0, 2, 4, 6) + FOLD(a[0], a[1], 1, 3, 5, 7);
    const vf t1 = FOLD(a[2], a[3], 0, 2, 4, 6) + FOLD(a[2], a[3], 1, 3, 5, 7);
    return FOLD(t0, t1, 0, 2, 4, 6) + FOLD(t0, t1, 1, 3, 5, 7);
}
#endif

/* One row's attention for head_dim HD (a multiple of 16, so of W). Keys are visited once for all heads:
 * a key's slot holds every kv head (kv_heads * HD floats, contiguous), so each byte of K and V
 * is read from memory once per row, whatever the GQA group size; the pool layer does not fit
 * in L2, so these reads are what a decode step waits for. q and the per-head partial sums and
 * accumulators live in stack arrays (registers for small models, L1 otherwise), at most
 * (2 * MAX_HEADS * HD / W + MAX_HEADS * W) vectors (at most 320 KiB for HD 256) on an OpenMP
 * thread's stack; more heads take row_any. kv_of[h] = h / group.
 * A row's pages lie anywhere in the pool, so each page switch would be a DRAM (and TLB) miss
 * that the hardware prefetcher cannot foresee (3x slower than pages in order, measured on
 * AVX2): while reading slot j of one page, slot j of the page AHEAD pages on is prefetched. */
#define MAX_HEADS 128
#define AHEAD 2
INLINE void prefetch_slot(const float *pool, const int64_t *table, int64_t p, int64_t pages, int64_t j,
                          int64_t page_size, int64_t slot_stride) {
    if (p >= pages) return;
    const char *at = (const char *)(pool + (table[p] * page_size + j) * slot_stride);
    for (int64_t b = 0; b < slot_stride * (int64_t)sizeof(float); b += 64) __builtin_prefetch(at + b);
}
#define DEFINE_ROW(HD)                                                                          \
static void row_##HD(const float *qb, const float *k, const float *v, const int64_t *table,   \
                     int64_t len, float *ob, float *scratch, int64_t heads,                   \
                     const int64_t *kv_of, int64_t slot_stride, int64_t page_size, float scale) { \
    enum { C = (HD) / W };                                                                        \
    const int64_t stride = (len + 15) & ~(int64_t)15;  /* scores per head, padded */            \
    vf q[heads * C];                                                                           \
    for (int64_t x = 0; x < heads * C; x++) q[x] = *(const vf *)(qb + W * x) * scale;           \
    vf part[heads * W];  /* part[h * W + i]: head h, key t0 + i, unreduced */                  \
    const int64_t pages = (len + page_size - 1) / page_size;                                   \
    int64_t pi = 0, j = 0;  /* page index in the table and slot in the page of the next key */ \
    for (int64_t t0 = 0; t0 < len; t0 += W) {                                                    \
        const int64_t n = len - t0 < W ? len - t0 : W;                                          \
        for (int64_t i = 0; i < n; i++) {                                                       \
            prefetch_slot(k, table, pi + AHEAD, pages, j, page_size, slot_stride);              \
            const float *kr = k + (table[pi] * page_size + j) * slot_stride;                    \
            for (int64_t h = 0; h < heads; h++) {                                               \
                const float *kh = kr + kv_of[h] * (HD);                                         \
                const vf *qh = q + h * C;                                                        \
                vf acc = qh[0] * *(const vf *)kh;                                                 \
                for (int c = 1; c < C; c++) acc += qh[c] * *(const vf *)(kh + W * c);           \
                part[h * W + i] = acc;                                                          \
            }                                                                                   \
            if (++j == page_size) { j = 0; pi++; }                                              \
        }                                                                                       \
        for (int64_t h = 0; h < heads; h++) {                                                   \
            for (int64_t i = n; i < W; i++) part[h * W + i] = (vf){0};                            \
            *(vf *)(scratch + h * stride + t0) = hsum_w(part + h * W);                           \
        }                                                                                       \
    }                                                                                           \
    softmax_rows(scratch, heads, len, stride);                                                 \
    vf acc[heads * C];                                                                         \
    for (int64_t x = 0; x < heads * C; x++) acc[x] = (vf){0};                                   \
    pi = 0, j = 0;                                                                              \
    for (int64_t t = 0; t < len; t++) {                                                         \
        prefetch_slot(v, table, pi + AHEAD, pages, j, page_size, slot_stride);                  \
        const float *vr = v + (table[pi] * page_size + j) * slot_stride;                        \
        for (int64_t h = 0; h < heads; h++) {                                                   \
            const float w = scratch[h * stride + t];                                            \
            const float *vh = vr + kv_of[h] * (HD);                                             \
            for (int c = 0; c < C; c++) acc[h * C + c] += w * *(const vf *)(vh + W * c);         \
        }                                                                                       \
        if (++j == page_size) { j = 0; pi++; }                                                  \
    }                                                                                           \
    for (int64_t x = 0; x < heads * C; x++) *(vf *)(ob + W * x) = acc[x];                       \
}
DEFINE_ROW(32)
DEFINE_ROW(64)
DEFINE_ROW(128)
DEFINE_ROW(256)

/* Any other head_dim: the same steps, scalar. */
static void row_any(const float *qb, const float *k, const float *v, const int64_t *table,
                    int64_t len, float *ob, float *scratch, int64_t heads, const int64_t *kv_of,
                    int64_t slot_stride, int64_t page_size, int64_t hd, float scale) {
    const int64_t stride = (len + 15) & ~(int64_t)15;
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = qb + h * hd;
        const int64_t off = kv_of[h] * hd;
        for (int64_t t = 0; t < len; t++) {
            const float *kr = k + (table[t / page_size] * page_size + t % page_size) * slot_stride + off;
            float acc = 0.0f;
            for (int64_t i = 0; i < hd; i++) acc += qh[i] * kr[i];
            scratch[h * stride + t] = acc * scale;
        }
    }
    softmax_rows(scratch, heads, len, stride);
    for (int64_t h = 0; h < heads; h++) {
        float *oh = ob + h * hd;
        const int64_t off = kv_of[h] * hd;
        for (int64_t i = 0; i < hd; i++) oh[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const float *vr = v + (table[t / page_size] * page_size + t % page_size) * slot_stride + off;
            const float w = scratch[h * stride + t];
            for (int64_t i = 0; i < hd; i++) oh[i] += w * vr[i];
        }
    }
}

/* q:   [rows, heads, head_dim], row stride q_stride floats (heads * head_dim when packed)
 * k,v: one layer's pool, [slots, kv_heads, head_dim] contiguous
 * pages / page_start: the rows' page tables back to back; row b's are pages[page_start[b] ..]
 * lens: keys of each row (its new token's position + 1); the new token is already in the pool
 * out:  [rows, heads, head_dim] packed
 * scratch: threads * scratch_stride floats, scratch_stride >= heads * max(lens) rounded up to 16
 * kv_of: heads int64s of room (filled here: the kv head each query head reads)
 * Rows are shared among `threads` OpenMP threads. The library is linked against libgomp.so.1,
 * which torch's CPU wheels also load under that name: the process has one OpenMP runtime and
 * this runs on torch's own (already warm) threads. */
void pdtb_paged_decode_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                           const int64_t *pages, const int64_t *page_start, const int64_t *lens,
                           float *out, float *scratch, int64_t scratch_stride, int64_t *kv_of,
                           int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t page_size, float scale, int64_t threads) {
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * head_dim;
    for (int64_t h = 0; h < heads; h++) kv_of[h] = h / group;
    const int which = heads <= MAX_HEADS ? (int)head_dim : 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if(threads > 1 && rows > 1)
    for (int64_t b = 0; b < rows; b++) {
        float *mine = scratch + omp_get_thread_num() * scratch_stride;
#define ARGS q + b * q_stride, k, v, pages + page_start[b], lens[b], out + b * heads * head_dim, \
             mine, heads, kv_of, slot_stride, page_size
        switch (which) {
            case 32: row_32(ARGS, scale); break;
            case 64: row_64(ARGS, scale); break;
            case 128: row_128(ARGS, scale); break;
            case 256: row_256(ARGS, scale); break;
            default: row_any(ARGS, head_dim, scale); break;
        }
#undef ARGS
    }
}
