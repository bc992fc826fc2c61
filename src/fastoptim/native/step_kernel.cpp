// One optimizer step over a bucket's tensors, block by block: the rule's update run over each block a register's
// lanes at a time (lanes.hpp; a block's last few elements one at a time) with p and g read in place, each state
// met as its codec says (decoded into an fp32 array in L1 first, or in the loop; stored after it, as computed, or
// in the next block's loop). A template: paths/cpu_kernel/kernels.kernel_source fills each $${name} with the
// pieces of one rule, its FLAGS and state formats (the update as C++ statements, and per state its codec's).
#include "codec.hpp"
#include "minifloat.hpp"
#include "lanes.hpp"

// a tensor's row in the table: these columns, then each active state's addresses (kernels._column_names)
constexpr int64_t FIRST_BLOCK = 0, ROWS = 1, LENGTH = 2, PARAM = 3, GRAD = 4;
constexpr int64_t WIDTH = ${width};  // columns in a row
constexpr int64_t BLOCK = ${block};  // elements in a block (the codec's; a 16-bit state's piece)

// quantized states' constants: the 4-bit boundaries; the 8-bit encoder's cell tables
${constants}

// runs global blocks [begin, end) of the n_tensors tensors of table; sc: the step's scalars; grad_mul: null or
// the grad multiplier; maps: per state, its map's values and quant.Encoder's table
extern "C" void fo_step(const int64_t* table, int64_t n_tensors, int64_t begin, int64_t end,
                        const float* sc, const float* grad_mul, const void* const* maps) {
    const float gm = grad_mul ? *grad_mul : 1.0f;
    (void)gm; (void)maps; (void)sc;
${scalars}
${codecs}
    // the block-scaled states' last block, its codes written while the update runs over the next (Deferred)
${deferred_decls}
    int64_t n_last = 0;
    int cur = 0;
    (void)cur;
    // the block walk: tensor t, row r, block j of the row (one division, at the start)
    int64_t t = 0;
    while (t + 1 < n_tensors && table[(t + 1) * WIDTH] <= begin) ++t;
    const int64_t* row = table + t * WIDTH;
    int64_t length = row[LENGTH], nblocks = (length + BLOCK - 1) / BLOCK;
    int64_t r = (begin - row[FIRST_BLOCK]) / nblocks, j = (begin - row[FIRST_BLOCK]) % nblocks;
    for (int64_t b = begin; b < end; ++b) {
        const int64_t at = r * length + j * BLOCK;
        const int64_t rest = length - j * BLOCK;
        const int64_t n = rest < BLOCK ? rest : BLOCK;
        float* __restrict__ P = reinterpret_cast<float*>(row[PARAM]) + at;
        const float* __restrict__ G = reinterpret_cast<const float*>(row[GRAD]) + at;
        ${arrays}
        ${tops}
${loads}
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            const Lanes p_ = fo_lanes(P + i);
            const Lanes g_ = fo_lanes(G + i) * gm;
${lane_reads}
${lane_body}
${lane_writes}
            if (i + LANES <= n_last) {
${deferred_lanes}
            }
        }
        {  // the last block's codes that the loop did not write
            const int64_t lanes_end = i;
            i = lanes_end < (n_last & -LANES) ? lanes_end : (n_last & -LANES);
${deferred_rest}
            i = lanes_end;
        }
${tails}
        for (; i < n; ++i) {
            const float p_ = P[i];
            const float g_ = G[i] * gm;
${reads}
${body}
${writes}
        }
${merge_tops}
${stores}
${deferred_finish}
        n_last = n;
        cur ^= 1;
        if (++j == nblocks) {  // the next block: the row's next, the next row's first, or the next tensor's first
            j = 0;
            if (++r == row[ROWS] && t + 1 < n_tensors) {
                r = 0;
                row = table + ++t * WIDTH;
                length = row[LENGTH];
                nblocks = (length + BLOCK - 1) / BLOCK;
            }
        }
    }
    {  // the last block's codes
        const int64_t i = 0;
        (void)i;
${deferred_flush}
    }
}

// fo_step over chunks [cuts[k], cuts[k + 1]), taken in turn by the threads of a team of the OpenMP runtime torch
// runs on (its GOMP_parallel, found by the caller): torch's own worker threads, which spin a while after each torch
// op, take the work, instead of spinning beside threads of ours on the same cores
struct FoJob {
    const int64_t* table; int64_t n_tensors; const int64_t* cuts; int64_t n_chunks;
    const float* sc; const float* grad_mul; const void* const* maps; std::atomic<int64_t> next;
};
static void fo_worker(void* data) {
    FoJob* job = static_cast<FoJob*>(data);
    for (int64_t k; (k = job->next.fetch_add(1)) < job->n_chunks;)
        fo_step(job->table, job->n_tensors, job->cuts[k], job->cuts[k + 1], job->sc, job->grad_mul, job->maps);
}
extern "C" void fo_step_team(void* gomp_parallel, uint32_t threads, const int64_t* table, int64_t n_tensors,
                             const int64_t* cuts, int64_t n_chunks, const float* sc, const float* grad_mul,
                             const void* const* maps) {
    FoJob job{table, n_tensors, cuts, n_chunks, sc, grad_mul, maps, {0}};
    reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(gomp_parallel)(fo_worker, &job, threads, 0);
}

// one state's codec on one block, as fo_step runs it: x given, its codes and absmax (the largest magnitude, as the
// codec's store keeps it: ``scale``); else the values of codes and absmax
using FoEncode = void (*)(const float*, int64_t, float, const Codec&, uint8_t*);
using FoDecode = void (*)(const uint8_t*, int64_t, const Codec&, float, float*);
[[maybe_unused]] static float fo_same(float amax) { return amax; }
[[maybe_unused]] static void fo_probe(const Codec& codec, FoEncode encode, FoDecode decode, const float* x, int64_t n,
                                      uint8_t* codes, float* absmax, float* out, float (*scale)(float) = fo_same) {
    if (x) {
        uint32_t top = 0;
        for (int64_t i = 0; i < n; ++i) top = top > magnitude_bits(x[i]) ? top : magnitude_bits(x[i]);
        *absmax = scale(from_bits(top));
        encode(x, n, *absmax == 0.0f ? 1.0f : *absmax, codec, codes);
    } else {
        decode(codes, n, codec, *absmax, out);
    }
}

// the codec of state k on one block, as fo_step runs it (for tests): x given, its codes and absmax; else the
// values of codes and absmax
extern "C" void fo_codec(const void* const* maps, int64_t k, const float* x, int64_t n, uint8_t* codes, float* absmax,
                         float* out) {
    (void)maps; (void)k; (void)x; (void)n; (void)codes; (void)absmax; (void)out;
${probes}
}
