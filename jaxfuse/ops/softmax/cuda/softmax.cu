// Softmax, log-softmax and the softmax cross-entropy over long rows, each row held in the
// registers of one thread-block cluster (rows.cuh). The forward reads x once and writes y once,
// the backward reads y and dy once and writes dx once, and the cross-entropy reads the logits
// once and writes their gradient in the same pass, where a Pallas program that cannot hold such
// a row walks it twice. The cross-entropy streams its long rows instead (see below).
//
// The kernels are persistent: a cluster walks rows c, c + clusters, ..., and (with 4 vectors or
// fewer per thread) loads its next row before it reduces the current one. Rows are reduced as
// (max, sum of exp2(z - max)) pairs in base 2 (z = x * scale * log2 e), so every exponential is
// one exp2 and the whole row needs one cluster barrier.
//
// The exponentials on each row's path, not the walk or the cluster barrier, keep the forward
// of rows over several CTAs short of the copy: the same kernel writing x back instead of its
// softmax comes closer to it, and that variant gains nothing without the barrier. exp2f stays:
// its single-instruction form (ex2.approx.ftz, which drops exp2f's subnormal fix-ups) measured
// slower on the H100.
#include "rows.cuh"

namespace jaxfuse {
namespace {

constexpr int kThreads = 512;
// 16-byte vectors a thread holds of a row, over all the streams it reads: more would spill.
constexpr int kMaxVectors = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Parts of a row as (max z, sum of exp2(z - max z)[, sum of z]). A part with nothing in it is
// (-inf, 0[, 0]), and a NaN anywhere makes the sum NaN, which then reaches every output of its
// row.
__device__ __forceinline__ float rescaled(float sum, float max, float to) {
  return max == to ? sum : sum * exp2f(max - to);
}

// Merges every thread's part over the cluster. At each level (a warp, the CTA's warps, the
// cluster's CTAs) the maximum is reduced first and then the sums, each rescaled to it once:
// every merge is a plain max or add, none waits on another's exponential. The butterflies give
// every lane the same bits, and every CTA folds the cluster's parts in the same order.
template <bool kClusters, bool kTotal>
__device__ __forceinline__ float3 cluster_max_sum(float3 part, ClusterScratch<float3>& scratch,
                                                  int parity) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const ClusterOf<kClusters> cluster;
  const int ranks = static_cast<int>(cluster.num_blocks());
  auto merge_warp = [](float3 p) {
    float m = p.x;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, shuffle(m, offset, true));
    float sum = rescaled(p.y, p.x, m), total = p.z;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += shuffle(sum, offset, true);
      if (kTotal) total += shuffle(total, offset, true);
    }
    return make_float3(m, sum, total);
  };
  part = merge_warp(part);
  if (lane == 0) scratch.warp[warp] = part;
  __syncthreads();
  if (warp == 0) {
    part = merge_warp(lane < warps ? scratch.warp[lane] : make_float3(-INFINITY, 0.f, 0.f));
    if (lane < ranks)
      *cluster.map_shared_rank(&scratch.slot[parity][cluster.block_rank()], lane) = part;
  }
  cluster.sync();
  const float3* parts = scratch.slot[parity];
  float m = -INFINITY, sum = 0.f, total = 0.f;
  for (int r = 0; r < ranks; ++r) m = fmaxf(m, parts[r].x);
  for (int r = 0; r < ranks; ++r) {
    sum += rescaled(parts[r].y, parts[r].x, m);
    if (kTotal) total += parts[r].z;
  }
  return make_float3(m, sum, total);
}

// The subtrahend that makes exp2(z - shift) safe: a row (or part) with no finite maximum has
// only -inf (or NaN) in it, and shifting by 0 keeps -inf - shift from turning into NaN.
__device__ __forceinline__ float safe_shift(float max) { return max == -INFINITY ? 0.f : max; }

constexpr uint32_t kAllKept = (1u << kUnit) - 1u;

// Unit k's kept bits of a row's (see row_kept_bits), all of them without kMasked.
template <bool kMasked>
__device__ __forceinline__ uint32_t unit_kept(uint64_t kept, int k) {
  return kMasked ? static_cast<uint32_t>(kept >> (kUnit * k)) & kAllKept : kAllKept;
}

// This thread's (max, sum) of z = x * scale2 over the units it holds, and the sum of z over
// the columns before `counted`. unit(k, v) writes unit k's values to v. With kMasked, `kept`
// holds the bits of the keys that take part (a unit wholly kept, the common case, costs one
// comparison); without, the masking code is not there to hold registers.
template <int V, bool kMasked, typename UnitValues>
__device__ __forceinline__ float3 thread_max_sum(UnitValues unit, const RowSlice& slice,
                                                 float scale2, bool with_total, int counted,
                                                 uint64_t kept) {
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (!slice.holds(k)) continue;
    float v[kUnit];
    unit(k, v);
    const uint32_t bits = unit_kept<kMasked>(kept, k);
    if (bits == kAllKept) {
#pragma unroll
      for (int e = 0; e < kUnit; ++e) m = fmaxf(m, v[e] * scale2);
    } else {
#pragma unroll
      for (int e = 0; e < kUnit; ++e) m = fmaxf(m, bits >> e & 1u ? v[e] * scale2 : -INFINITY);
    }
  }
  const float shift = safe_shift(m);
  float sum = 0.f, total = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (!slice.holds(k)) continue;
    float v[kUnit];
    unit(k, v);
    const int column = slice.column(k);
    const uint32_t bits = unit_kept<kMasked>(kept, k);
    if (bits == kAllKept) {
      sum += unit_sum([&](int e) { return exp2f(fmaf(v[e], scale2, -shift)); });
    } else {
      sum += unit_sum(
          [&](int e) { return bits >> e & 1u ? exp2f(fmaf(v[e], scale2, -shift)) : 0.f; });
    }
    if (with_total)
      total += unit_sum([&](int e) { return column + e < counted ? v[e] * scale2 : 0.f; });
  }
  return make_float3(m, sum, total);
}

// The most queries of causal rows, for CausalEnds's 32-bit walk.
constexpr int64_t kMaxCausalQueries = int64_t{1} << 30;

// The maximum of (size, stride) groups a boolean mask's row offsets are read through.
constexpr int kMaxMaskGroups = 4;

// Which keys of the softmax forward's rows take part. Causal (causal_rows > 0): row r holds the
// keys of query r % causal_rows, and keys past that query plus causal_offset are masked. A
// boolean mask (1 keeps) is read in place: row r's multi-index over `groups` (size, stride)
// pairs of x's leading dimensions, innermost last, gives its offset in the mask, and its keys
// are `column_stride` (1, or 0 for one value a row) apart. Masked keys give 0 in the softmax,
// -inf in the log-softmax.
struct RowKeys {
  int64_t causal_rows;
  int causal_offset;
  const uint8_t* mask;  // nullptr: no boolean mask
  int groups;
  int64_t sizes[kMaxMaskGroups], strides[kMaxMaskGroups];
  int64_t column_stride;

  __device__ __forceinline__ const uint8_t* mask_row(int64_t r) const {
    if (mask == nullptr) return nullptr;
    int64_t offset = 0;
    for (int g = groups - 1; g >= 0; --g) {
      offset += r % sizes[g] * strides[g];
      r /= sizes[g];
    }
    return mask + offset;
  }
};

// The kept bits of the unit at `column` of a row: before `limit`, and where `mask_row` (or
// nullptr) keeps them.
__device__ __forceinline__ uint32_t kept_bits(int column, int limit, const uint8_t* mask_row,
                                              int64_t column_stride) {
  const int before = limit - column;
  uint32_t bits = before >= kUnit ? kAllKept : before <= 0 ? 0u : (1u << before) - 1u;
  if (mask_row != nullptr) {
    if (column_stride == 0) {
      bits = *mask_row ? bits : 0u;
    } else {
      // Eight keys' bytes in one load: a row's offset and every unit's column are multiples of
      // 8 (the mask's dense strides, and rows of whole units).
      const uint2 w = __ldg(reinterpret_cast<const uint2*>(mask_row + column));
      uint32_t keep = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        keep |= (w.x >> 8 * e & 0xffu) ? 1u << e : 0u;
        keep |= (w.y >> 8 * e & 0xffu) ? 1u << (e + 4) : 0u;
      }
      bits &= keep;
    }
  }
  return bits;
}

// The kept bits of this thread's units of a row, unit k's at bits [8k, 8k + 8): read once a
// row, for the three passes over its units.
template <int V>
__device__ __forceinline__ uint64_t row_kept_bits(const RowSlice& slice, int limit,
                                                  const uint8_t* mask_row,
                                                  int64_t column_stride) {
  static_assert(V * kUnit <= 64, "a thread's kept bits fill one 64-bit word");
  uint64_t kept = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (slice.holds(k))
      kept |= uint64_t{kept_bits(slice.column(k), limit, mask_row, column_stride)} << (kUnit * k);
  }
  return kept;
}

// The first masked column of each causal row a feed fetches (n without a causal mask), walked
// beside its fetches: keys past a row's query, about half of causal scores, are never read. The
// query r % causal_rows advances a step at a time beside r, one division before the walk rather
// than one a row, in 32 bits: query + offset + 1 stays within 2 causal_rows + n.
struct CausalEnds {
  int queries, step, query, offset;  // of the next row fetched; queries 0: no causal mask
  int lag_step;                      // the query steps from the held row to the next fetched

  __device__ __forceinline__ static CausalEnds along(int64_t causal_rows, int offset,
                                                     const RowWalk& walk) {
    if (causal_rows == 0) return {0, 0, 0, 0, 0};
    return {static_cast<int>(causal_rows), static_cast<int>(walk.step % causal_rows),
            static_cast<int>(walk.first % causal_rows), offset, 0};
  }
  __device__ __forceinline__ void lag(int rows) {
    lag_step = queries == 0 ? 0 : static_cast<int>(int64_t{rows} * step % queries);
  }
  __device__ __forceinline__ int next_end(int n) {
    const int end = of(query, n);
    query += step;
    query -= query >= queries ? queries : 0;
    return end;
  }
  __device__ __forceinline__ int held_end(int n) const {
    const int held = query - lag_step;
    return of(held < 0 ? held + queries : held, n);
  }

 private:
  __device__ __forceinline__ int of(int q, int n) const {
    return queries == 0 ? n : min(max(q + offset + 1, 0), n);
  }
};

// What a kernel's feeds read of each row: up to the causal limits with kCausal, else all of it.
template <bool kCausal>
__device__ __forceinline__ auto row_ends(int64_t causal_rows, int causal_offset,
                                         const RowWalk& walk) {
  if constexpr (kCausal) return CausalEnds::along(causal_rows, causal_offset, walk);
  else return WholeRows{};
}

// Built apart with kMasked (causal or boolean masks, RowKeys) and without, so that rows with
// every key kept carry none of the masks' registers.
template <typename T, bool kLog, int V, bool kStaged, bool kClusters, bool kMasked>
__global__ void __launch_bounds__(kThreads, 2)
    softmax_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int n,
                           float scale2, int stages, RowKeys keys) {
  __shared__ ClusterScratch<float3> scratch;
  extern __shared__ uint4 staging[];
  const RowSlice slice = RowSlice::mine<kClusters>(V, n);
  const RowWalk walk = RowWalk::of_cluster<kClusters>();
  auto ends = row_ends<kMasked>(keys.causal_rows, keys.causal_offset, walk);
  auto xs = feed_of<RowFeed<T, V, kStaged, 1, decltype(ends)>>(x, rows, n, walk, slice, staging,
                                                                stages, ends);
  int parity = 0;
  xs.start();
  int64_t i = 0;
  for (int64_t r = walk.first; r < rows; r += walk.step, ++i) {
    xs.load(i);
    const int limit = xs.held_end();
    const uint64_t kept =
        kMasked ? row_kept_bits<V>(slice, limit, keys.mask_row(r), keys.column_stride) : 0;
    const float3 part = thread_max_sum<V, kMasked>(
        [&](int k, float (&v)[kUnit]) { xs.now[k].unpack(v); }, slice, scale2, false, n, kept);
    xs.refill(i);
    const float3 row = cluster_max_sum<kClusters, false>(part, scratch, parity);
    parity ^= 1;
    const float shift = safe_shift(row.x);
    // log: (z - shift) ln 2 - ln(sum); softmax: exp2(z - shift) / sum, 0 when every z is -inf.
    const float log_sum = logf(row.y), inverse = row.y == 0.f ? 0.f : 1.f / row.y;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!slice.holds(k)) continue;
      float v[kUnit];
      xs.now[k].unpack(v);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) {
        const float z = fmaf(v[e], scale2, -shift);
        v[e] = kLog ? z * kLn2 - log_sum : exp2f(z) * inverse;
      }
      const uint32_t bits = unit_kept<kMasked>(kept, k);
      if (bits != kAllKept) {
#pragma unroll
        for (int e = 0; e < kUnit; ++e) v[e] = bits >> e & 1u ? v[e] : (kLog ? -INFINITY : 0.f);
      }
      Unit<T> out;
      out.pack(v);
      out.store_streaming(y + r * n + slice.column(k));
    }
  }
}

// softmax: dx = scale * y * (dy - sum(dy * y)); log-softmax: dx = scale * (dy - exp(y) sum(dy))
// with masked entries (y = -inf) taking no part and getting zero. Causal rows (as the forward's)
// are read only up to their query's last key: the units past it take no part and get zero.
// Built apart with kMasked (causal) and without, as the forward.
template <typename T, bool kLog, int V, bool kClusters, bool kMasked>
__global__ void __launch_bounds__(kThreads, 2)
    softmax_backward_kernel(const T* __restrict__ y, const T* __restrict__ dy,
                            T* __restrict__ dx, int64_t rows, int n, float scale,
                            int64_t causal_rows, int causal_offset) {
  __shared__ ClusterScratch<float> scratch;
  const RowSlice slice = RowSlice::mine<kClusters>(V, n);
  const RowWalk walk = RowWalk::of_cluster<kClusters>();
  auto ends = row_ends<kMasked>(causal_rows, causal_offset, walk);
  // Two streams through registers: staged feeds would each count their own copy groups.
  using Feed = RowFeed<T, V, false, 2, decltype(ends)>;
  auto ys = feed_of<Feed>(y, rows, n, walk, slice, nullptr, 0, ends);
  auto dys = feed_of<Feed>(dy, rows, n, walk, slice, nullptr, 0, ends);
  int parity = 0;
  ys.start();
  dys.start();
  int64_t i = 0;
  for (int64_t r = walk.first; r < rows; r += walk.step, ++i) {
    ys.load(i);
    dys.load(i);
    // Units past the end were not read: zeros, which add nothing to either row term.
    const int end = ys.held_end();
    float mine = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!slice.holds(k)) continue;
      float yv[kUnit], dyv[kUnit];
      ys.now[k].unpack(yv);
      dys.now[k].unpack(dyv);
      mine += unit_sum([&](int e) { return kLog ? (yv[e] > -INFINITY ? dyv[e] : 0.f)
                                                : dyv[e] * yv[e]; });
    }
    ys.refill(i);
    dys.refill(i);
    const float c = cluster_reduce<kClusters>(mine, 0.f, Sum{}, scratch, parity);
    parity ^= 1;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!slice.holds(k)) continue;
      float yv[kUnit], dyv[kUnit];
      ys.now[k].unpack(yv);
      dys.now[k].unpack(dyv);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) {
        const float g = kLog ? (yv[e] > -INFINITY ? dyv[e] - exp2f(yv[e] * kLog2e) * c : 0.f)
                             : yv[e] * (dyv[e] - c);
        yv[e] = g * scale;
      }
      if (kMasked && slice.column(k) >= end) fill(yv, 0.f);
      Unit<T> out;
      out.pack(yv);
      out.store_streaming(dx + r * n + slice.column(k));
    }
  }
}

struct CrossEntropyArgs {
  const int32_t* labels;
  // Per-row cotangent scales of the fused gradient (stride 0: one scale for every row).
  const float* row_scale;
  int64_t scale_stride;
  float* loss;
  float* lse;  // written when there is no gradient (the per-row loss keeps it for its backward)
  float smoothing, z_loss;
  int32_t ignore_index;
  bool has_ignore;
  // The logits of a fused linear layer: a float32 bias added to each row (or nullptr), and the
  // row's first `counted` columns the classes, the rest padding to whole tiles that takes no
  // part and gets a zero gradient. A plain cross-entropy counts all n.
  const float* bias;
  int counted;
};

// Per row: loss = lse - (1 - s) x[label] - s mean(x) + z_loss lse^2, and with kGrad the
// gradient of row_scale * loss, exp(x - lse) (1 + 2 z_loss lse) row_scale - target row_scale
// with target = (1 - s) onehot(label) + s / V, written from the registers that hold the row,
// as G (the float32 logits of a fused linear layer give their gradient in its operands' dtype).
// Rows whose label is ignored, or outside [0, V), get a zero loss and gradient.
template <typename T, bool kGrad, int V, bool kStaged, bool kClusters, typename G = T>
__global__ void __launch_bounds__(kThreads, 2)
    cross_entropy_kernel(const T* __restrict__ logits, G* __restrict__ grad, int64_t rows,
                         int n, CrossEntropyArgs args, int stages) {
  __shared__ ClusterScratch<float3> scratch;
  extern __shared__ uint4 staging[];
  const RowSlice slice = RowSlice::mine<kClusters>(V, n);
  const RowWalk walk = RowWalk::of_cluster<kClusters>();
  const bool leader = ClusterOf<kClusters>().block_rank() == 0 && threadIdx.x == 0;
  const int classes = args.counted;
  auto xs = feed_of<RowFeed<T, V, kStaged, 1>>(logits, rows, n, walk, slice, staging, stages);
  auto unit = [&](int k, float (&v)[kUnit]) {
    xs.now[k].unpack(v);
    const int column = slice.column(k);
    if (args.bias != nullptr) {
      const float4 low = __ldg(reinterpret_cast<const float4*>(args.bias + column));
      const float4 high = __ldg(reinterpret_cast<const float4*>(args.bias + column) + 1);
      const float b[kUnit] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
#pragma unroll
      for (int e = 0; e < kUnit; ++e) v[e] += b[e];
    }
    if (column + kUnit > classes) {
#pragma unroll
      for (int e = 0; e < kUnit; ++e) v[e] = column + e < classes ? v[e] : -INFINITY;
    }
  };
  int parity = 0;
  xs.start();
  int64_t i = 0;
  for (int64_t r = walk.first; r < rows; r += walk.step, ++i) {
    xs.load(i);
    const int label = __ldg(args.labels + r);
    const bool valid =
        label >= 0 && label < classes && !(args.has_ignore && label == args.ignore_index);
    const float3 mine =
        thread_max_sum<V, false>(unit, slice, kLog2e, args.smoothing != 0.f, classes, 0);
    // The thread holding the label's logit picks it from its registers and writes the loss.
    bool owner = false;
    float picked = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int offset = label - slice.column(k);
      if (!valid || !slice.holds(k) || offset < 0 || offset >= kUnit) continue;
      float v[kUnit];
      unit(k, v);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) picked = e == offset ? v[e] : picked;
      owner = true;
    }
    xs.refill(i);
    const float3 row = args.smoothing != 0.f
                           ? cluster_max_sum<kClusters, true>(mine, scratch, parity)
                           : cluster_max_sum<kClusters, false>(mine, scratch, parity);
    parity ^= 1;
    const float lse2 = safe_shift(row.x) + log2f(row.y), lse = lse2 * kLn2;
    if (owner) {
      float loss = lse - (1.f - args.smoothing) * picked;
      if (args.smoothing != 0.f) loss -= args.smoothing * kLn2 / classes * row.z;
      if (args.z_loss != 0.f) loss += args.z_loss * lse * lse;
      args.loss[r] = loss;
    } else if (!valid && leader) {
      args.loss[r] = 0.f;
    }
    if (!kGrad && leader) args.lse[r] = lse;
    if constexpr (kGrad) {
      const float row_scale = valid ? __ldg(args.row_scale + r * args.scale_stride) : 0.f;
      const float prob_scale = row_scale * (1.f + 2.f * args.z_loss * lse);
      const float spread = args.smoothing / classes * row_scale;
      const float hit = (1.f - args.smoothing) * row_scale;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (!slice.holds(k)) continue;
        float v[kUnit];
        unit(k, v);
        const int column = slice.column(k);
#pragma unroll
        for (int e = 0; e < kUnit; ++e) {
          const float target = column + e == label ? hit + spread : spread;
          // Padding columns get an exact zero, even in a row whose scale is NaN: a product
          // with the weight's zero padding must not carry it into the real columns.
          v[e] = column + e < classes ? exp2f(fmaf(v[e], kLog2e, -lse2)) * prob_scale - target
                                      : 0.f;
        }
        Unit<G> out;
        out.pack(v);
        out.store_streaming(grad + r * n + column);
      }
    }
  }
}

// ---- Rows streamed by one CTA (a tiling of units=0), for rows too long to hold well.
//
// A cluster that holds a long row keeps no next row in flight (its slice leaves no registers
// for one) and waits on its barrier with nothing loading. A CTA that walks the row
// instead keeps kStreamVectors 16-byte loads a thread in flight from its first column to its
// last and reduces once at the end, as an online (max, sum); the gradient reads the row a
// second time, mostly from L2, which holds the rows of the CTAs in flight. Two CTAs of kThreads
// fit a SM (64 registers a thread), so smaller CTAs keep more rows in flight.
constexpr int kStreamVectors = 4;

// The first pass keeps its lines in L2 for the second; the second reads them for the last time.
template <typename T> __device__ __forceinline__ void load_for_reuse(Unit<T>& u, const T* p) {
#pragma unroll
  for (int i = 0; i < Unit<T>::kVectors; ++i)
    u.raw[i] = __ldcg(reinterpret_cast<const uint4*>(p) + i);
}

template <typename T, bool kGrad, typename G = T>
__global__ void __launch_bounds__(kThreads, 2)
    cross_entropy_streaming_kernel(const T* __restrict__ logits, G* __restrict__ grad,
                                   int64_t rows, int n, CrossEntropyArgs args) {
  constexpr int kUnits = kStreamVectors / Unit<T>::kVectors;
  __shared__ ClusterScratch<float3> scratch;
  const int classes = args.counted;
  // Unit k of a step at `base` starts at base + k * stride + mine: a warp's loads are contiguous.
  const int stride = static_cast<int>(blockDim.x) * kUnit, mine = threadIdx.x * kUnit;
  const int step = stride * kUnits;
  const bool smoothing = args.smoothing != 0.f;
  // Steps wholly inside the classes of a row without a bias (every step of a row but its last)
  // are unchecked; the rest see the padding, the row's end and the bias.
  const int unchecked_end = args.bias == nullptr ? classes / step * step : 0;
  // Calls visit(base, units, whole) at each step of `row`, its units loaded by `load` (none
  // past the row's end): the unchecked steps first, then the rest; `backwards`, the same steps
  // from the row's end, whose lines the forward walk loaded last and L2 most likely still holds
  // where the rows in flight outgrow it.
  auto walk = [&](const T* row, auto load, auto&& visit, auto backwards) {
    auto at = [&](int base, auto whole) {
      Unit<T> u[kUnits];
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        const int column = base + k * stride + mine;
        if (decltype(whole)::value || column < n) load(u[k], row + column);
      }
      visit(base, u, whole);
    };
    if constexpr (decltype(backwards)::value) {
      if (unchecked_end < n) {
        for (int base = unchecked_end + (n - 1 - unchecked_end) / step * step;
             base >= unchecked_end; base -= step) {
          at(base, std::false_type{});
        }
      }
      for (int base = unchecked_end - step; base >= 0; base -= step) at(base, std::true_type{});
    } else {
      int base = 0;
      for (; base < unchecked_end; base += step) at(base, std::true_type{});
      for (; base < n; base += step) at(base, std::false_type{});
    }
  };
  // The logits of the unit at `column` with the bias added; -inf past the classes or the row.
  auto logits_of = [&](const Unit<T>& u, int column, float (&v)[kUnit], auto whole) {
    if constexpr (decltype(whole)::value) {
      u.unpack(v);
    } else {
      if (column >= n) {
        fill(v, -INFINITY);
        return;
      }
      u.unpack(v);
#pragma unroll
      for (int e = 0; e < kUnit; ++e) {
        const float b = args.bias != nullptr ? __ldg(args.bias + column + e) : 0.f;
        v[e] = column + e < classes ? v[e] + b : -INFINITY;
      }
    }
  };
  int parity = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = logits + r * n;
    float m = -INFINITY, sum = 0.f, total = 0.f;
    // Each unit is unpacked twice (for the maximum, then the sum) rather than held unpacked:
    // a thread keeps only its loads in registers, and stays within two CTAs' share of them.
    walk(row, [](Unit<T>& u, const T* p) { load_for_reuse(u, p); },
         [&](int base, const auto& u, auto whole) {
      constexpr bool kWhole = decltype(whole)::value;
      float top = -INFINITY;
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        float v[kUnit];
        logits_of(u[k], base + k * stride + mine, v, whole);
#pragma unroll
        for (int e = 0; e < kUnit; ++e) top = fmaxf(top, v[e]);
      }
      // Rounding is monotonic: the scaled maximum is the maximum of the scaled logits.
      const float to = fmaxf(m, top * kLog2e), shift = safe_shift(to);
      sum = rescaled(sum, m, to);
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        const int column = base + k * stride + mine;
        float v[kUnit];
        logits_of(u[k], column, v, whole);
        sum += unit_sum([&](int e) { return exp2f(fmaf(v[e], kLog2e, -shift)); });
        if (smoothing) {
          total += unit_sum([&](int e) {
            return kWhole || (column < n && column + e < classes) ? v[e] * kLog2e : 0.f;
          });
        }
      }
      m = to;
    }, std::false_type{});
    const float3 part = make_float3(m, sum, total);
    const float3 stats = smoothing ? cluster_max_sum<false, true>(part, scratch, parity)
                                   : cluster_max_sum<false, false>(part, scratch, parity);
    parity ^= 1;
    const float lse2 = safe_shift(stats.x) + log2f(stats.y), lse = lse2 * kLn2;
    const int label = __ldg(args.labels + r);
    const bool valid =
        label >= 0 && label < classes && !(args.has_ignore && label == args.ignore_index);
    if (threadIdx.x == 0) {
      float loss = 0.f;
      if (valid) {
        const int column = label / kUnit * kUnit;
        Unit<T> u;
        load_for_reuse(u, row + column);
        float v[kUnit];
        logits_of(u, column, v, std::false_type{});
        loss = lse - (1.f - args.smoothing) * v[label - column];
        if (smoothing) loss -= args.smoothing * kLn2 / classes * stats.z;
        if (args.z_loss != 0.f) loss += args.z_loss * lse * lse;
      }
      args.loss[r] = loss;
      if (!kGrad) args.lse[r] = lse;
    }
    if constexpr (kGrad) {
      const float row_scale = valid ? __ldg(args.row_scale + r * args.scale_stride) : 0.f;
      const float prob_scale = row_scale * (1.f + 2.f * args.z_loss * lse);
      const float spread = args.smoothing / classes * row_scale;
      const float hit = (1.f - args.smoothing) * row_scale;
      walk(row, [](Unit<T>& u, const T* p) { u.load_streaming(p); },
           [&](int base, const auto& u, auto whole) {
        constexpr bool kWhole = decltype(whole)::value;
#pragma unroll
        for (int k = 0; k < kUnits; ++k) {
          const int column = base + k * stride + mine;
          if (!kWhole && column >= n) continue;
          float v[kUnit];
          logits_of(u[k], column, v, whole);
#pragma unroll
          for (int e = 0; e < kUnit; ++e) {
            // As in cross_entropy_kernel: padding gets an exact zero, even under a NaN scale.
            v[e] = kWhole || column + e < classes
                       ? exp2f(fmaf(v[e], kLog2e, -lse2)) * prob_scale - spread
                       : 0.f;
          }
          // The label's column, found once a unit rather than compared at each element.
          const int offset = label - column;
          if (offset >= 0 && offset < kUnit) {
#pragma unroll
            for (int e = 0; e < kUnit; ++e) v[e] -= e == offset ? hit : 0.f;
          }
          Unit<G> out;
          out.pack(v);
          out.store_streaming(grad + r * n + column);
        }
      }, std::true_type{});
    }
  }
}

// Calls f(kernel, dynamic shared bytes) with the instantiation for (element type, flag,
// tiling); false when there is none. Kernels reading kStreams arrays are built for the units
// that keep a thread's slices within kMaxVectors vectors, and staged only when kMayStage.
template <template <typename, bool, int, bool, bool> class Kernel, int kStreams, bool kMayStage,
          typename F>
bool dispatch_kernel(ffi::DataType dtype, bool flag, const Tiling& t, F&& f) {
  if (t.stages < 0 || (t.stages > 0 && !kMayStage)) return false;
  bool known = true;
  known &= dispatch_float(dtype, [&](auto type) {
    using T = decltype(type);
    constexpr int kMaxUnits = kMaxVectors / (Unit<T>::kVectors * kStreams);
    known &= dispatch_units<kMaxUnits>(t.units, [&](auto units) {
      constexpr int V = decltype(units)::value;
      auto launch = [&](auto staged) {
        constexpr bool kStaged = decltype(staged)::value;
        const size_t bytes =
            kStaged ? StagedFeed<T, V>::bytes(static_cast<int>(t.stages),
                                              static_cast<int>(t.threads))
                    : 0;
        with_clusters(t.cluster > 1, [&](auto clusters) {
          constexpr bool kClusters = decltype(clusters)::value;
          if (flag) f(Kernel<T, true, V, kStaged, kClusters>::get(), bytes);
          else f(Kernel<T, false, V, kStaged, kClusters>::get(), bytes);
        });
      };
      if constexpr (kMayStage) {
        if (t.stages > 0) launch(std::true_type{});
        else launch(std::false_type{});
      } else {
        launch(std::false_type{});
      }
    });
  });
  return known;
}

template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct Forward {
  static auto get() { return softmax_forward_kernel<T, kFlag, V, kStaged, kClusters, false>; }
};
template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct MaskedForward {
  static auto get() { return softmax_forward_kernel<T, kFlag, V, kStaged, kClusters, true>; }
};
template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct Backward {
  static auto get() { return softmax_backward_kernel<T, kFlag, V, kClusters, false>; }
};
template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct CausalBackward {
  static auto get() { return softmax_backward_kernel<T, kFlag, V, kClusters, true>; }
};
template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct CrossEntropy {
  static auto get() { return cross_entropy_kernel<T, kFlag, V, kStaged, kClusters>; }
};
// The gradient of float32 logits in G, a fused linear layer's operand dtype. Other logits, and
// the loss without a gradient, take the instantiations above.
template <typename G> struct CrossEntropyInto {
  template <typename T, bool kFlag, int V, bool kStaged, bool kClusters> struct Kernel {
    static auto get() {
      using Out = std::conditional_t<std::is_same_v<T, float> && kFlag, G, T>;
      return cross_entropy_kernel<T, kFlag, V, kStaged, kClusters, Out>;
    }
  };
};

dim3 grid_of(const Tiling& t) { return dim3(t.cluster * t.clusters, 1, 1); }

using ffi::DataType;

// Rows (R, N) of a type the kernels take.
bool check_rows(Checks& checks, const char* name, const ffi::AnyBuffer& rows) {
  return checks.rank(name, rows, 2, "(R, N)") &&
         checks.dtype(name, rows.element_type(), {DataType::F32, DataType::BF16, DataType::F16},
                      "float32, bfloat16 or float16");
}

// An output or second input of the same shape and dtype as `like`.
void check_like(Checks& checks, const char* name, const ffi::AnyBuffer& buffer,
                const char* like_name, const ffi::AnyBuffer& like) {
  checks.same_shape(name, buffer, like_name, like.dimensions());
  checks.require(buffer.element_type() == like.element_type(), [&] {
    return std::string(name) + " is " + dtype_name(buffer.element_type()) +
           ", which must match " + like_name + " (" + dtype_name(like.element_type()) + ")";
  });
}

ffi::Error unbuilt(const char* op, const Tiling& t, const ffi::AnyBuffer& x) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(op) + ": no kernel is built for " + t.describe() + " over " +
                        dtype_name(x.element_type()) + " rows");
}

// The boolean mask's reading pattern (RowKeys), checked against the rows and the mask's size,
// or a stand-in operand with has_mask = 0.
void check_mask(Checks& checks, const ffi::AnyBuffer& mask, int64_t has_mask, int64_t rows,
                int64_t n, ffi::Span<const int64_t> sizes, ffi::Span<const int64_t> strides,
                int64_t column_stride) {
  if (!checks.flag("has_mask", has_mask) || !has_mask) return;
  checks.require(mask.element_type() == DataType::PRED, [&] {
    return std::string("mask is ") + dtype_name(mask.element_type()) + ", not bool";
  });
  const int64_t groups = static_cast<int64_t>(sizes.size());
  checks.require(groups >= 1 && groups <= kMaxMaskGroups &&
                     static_cast<int64_t>(strides.size()) == groups, [&] {
    return "mask_sizes and mask_strides have " + std::to_string(groups) + " and " +
           std::to_string(strides.size()) + " entries; both need the same 1 to " +
           std::to_string(kMaxMaskGroups);
  });
  checks.range("mask_column_stride", column_stride, 0, 1);
  if (!checks.ok()) return;
  int64_t count = 1, last = (n - 1) * column_stride;
  bool aligned = true;
  for (int64_t g = 0; g < groups; ++g) {
    checks.range("mask_sizes", sizes[g], 1, rows);
    checks.range("mask_strides", strides[g], 0, mask.element_count());
    count *= std::max<int64_t>(sizes[g], 1);
    last += (sizes[g] - 1) * strides[g];
    aligned &= strides[g] % kUnit == 0;
  }
  checks.require(count == rows, [&] {
    return "mask_sizes multiply to " + std::to_string(count) + ", not the " +
           std::to_string(rows) + " rows";
  });
  checks.require(last < mask.element_count(), [&] {
    return "mask_strides reach element " + std::to_string(last) + " of a mask of " +
           std::to_string(mask.element_count());
  });
  // A row's keys are read eight at a time from offsets that are multiples of 8.
  checks.require(column_stride == 0 || aligned, [&] {
    return std::string("mask_strides must be multiples of 8 where keys are read in rows");
  });
}

// Causal rows come in whole blocks of queries, at most kMaxCausalQueries (the Python side's
// MAX_CAUSAL_QUERIES), and the offset is clamped to [-T, N] (as the Python side does), which
// masks the same and keeps the ends in int.
void check_causal(Checks& checks, int64_t causal_rows, int64_t causal_offset,
                  ffi::Span<const int64_t> dims) {
  checks.range("causal_rows", causal_rows, 0, std::min(dims[0], kMaxCausalQueries));
  checks.require(causal_rows == 0 || dims[0] % causal_rows == 0, [&] {
    return "causal_rows=" + std::to_string(causal_rows) + " does not divide the " +
           std::to_string(dims[0]) + " rows";
  });
  checks.range("causal_offset", causal_offset, -causal_rows, dims[1]);
}

ffi::Error SoftmaxForwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer mask,
                              ffi::Result<ffi::AnyBuffer> y, float scale, int64_t log,
                              int64_t causal_rows, int64_t causal_offset, int64_t has_mask,
                              ffi::Span<const int64_t> mask_sizes,
                              ffi::Span<const int64_t> mask_strides, int64_t mask_column_stride,
                              int64_t cluster, int64_t threads, int64_t units, int64_t stages,
                              int64_t clusters) {
  Checks checks("softmax_forward");
  if (!check_rows(checks, "x", x)) return checks.error();
  const auto dims = x.dimensions();
  const Tiling t{cluster, threads, units, stages, 0, clusters};
  check_like(checks, "y", *y, "x", x);
  checks.require(std::isfinite(scale), [&] { return "scale=" + std::to_string(scale) +
                                                    " must be finite"; });
  checks.flag("log", log);
  check_causal(checks, causal_rows, causal_offset, dims);
  check_mask(checks, mask, has_mask, dims[0], dims[1], mask_sizes, mask_strides,
             mask_column_stride);
  check_tiling(checks, dims[1], t, kThreads);
  if (!checks.ok()) return checks.error();
  if (dims[0] == 0) return ffi::Error::Success();
  RowKeys keys{causal_rows, static_cast<int>(causal_offset), nullptr, 1, {1}, {0},
               mask_column_stride};
  if (has_mask) {
    keys.mask = static_cast<const uint8_t*>(mask.untyped_data());
    keys.groups = static_cast<int>(mask_sizes.size());
    for (int g = 0; g < keys.groups; ++g) {
      keys.sizes[g] = mask_sizes[g];
      keys.strides[g] = mask_strides[g];
    }
  }
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto kernel, size_t bytes) {
    err = launch_clustered(kernel, grid_of(t), threads, cluster, bytes, stream, x.untyped_data(),
                           y->untyped_data(), dims[0], static_cast<int>(dims[1]),
                           scale * kLog2e, stages, keys);
  };
  const bool known = causal_rows > 0 || has_mask
                         ? dispatch_kernel<MaskedForward, 1, true>(x.element_type(), log, t, launch)
                         : dispatch_kernel<Forward, 1, true>(x.element_type(), log, t, launch);
  if (!known) return unbuilt("softmax_forward", t, x);
  return launch_error("softmax_forward", err);
}

ffi::Error SoftmaxBackwardImpl(cudaStream_t stream, ffi::AnyBuffer y, ffi::AnyBuffer dy,
                               ffi::Result<ffi::AnyBuffer> dx, float scale, int64_t log,
                               int64_t causal_rows, int64_t causal_offset, int64_t cluster,
                               int64_t threads, int64_t units, int64_t stages,
                               int64_t clusters) {
  Checks checks("softmax_backward");
  if (!check_rows(checks, "y", y)) return checks.error();
  const auto dims = y.dimensions();
  const Tiling t{cluster, threads, units, stages, 0, clusters};
  check_like(checks, "dy", dy, "y", y);
  check_like(checks, "dx", *dx, "y", y);
  checks.require(std::isfinite(scale), [&] { return "scale=" + std::to_string(scale) +
                                                    " must be finite"; });
  // Two streams through registers: the backward is not staged.
  checks.range("stages", stages, 0, 0);
  checks.flag("log", log);
  check_causal(checks, causal_rows, causal_offset, dims);
  check_tiling(checks, dims[1], t, kThreads);
  if (!checks.ok()) return checks.error();
  if (dims[0] == 0) return ffi::Error::Success();
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto kernel, size_t bytes) {
    err = launch_clustered(kernel, grid_of(t), threads, cluster, bytes, stream, y.untyped_data(),
                           dy.untyped_data(), dx->untyped_data(), dims[0],
                           static_cast<int>(dims[1]), scale, causal_rows,
                           static_cast<int>(causal_offset));
  };
  const bool known =
      causal_rows > 0
          ? dispatch_kernel<CausalBackward, 2, false>(y.element_type(), log, t, launch)
          : dispatch_kernel<Backward, 2, false>(y.element_type(), log, t, launch);
  if (!known) return unbuilt("softmax_backward", t, y);
  return launch_error("softmax_backward", err);
}

ffi::Error CrossEntropyImpl(cudaStream_t stream, ffi::AnyBuffer logits,
                            ffi::Buffer<ffi::DataType::S32> labels,
                            ffi::Buffer<ffi::DataType::F32> row_scale,
                            ffi::Buffer<ffi::DataType::F32> bias,
                            ffi::Result<ffi::Buffer<ffi::DataType::F32>> loss,
                            ffi::Result<ffi::AnyBuffer> lse_or_grad, float smoothing,
                            float z_loss, int64_t ignore_index, int64_t has_ignore,
                            int64_t with_grad, int64_t counted, int64_t cluster,
                            int64_t threads, int64_t units, int64_t stages, int64_t clusters) {
  Checks checks("cross_entropy");
  if (!check_rows(checks, "logits", logits)) return checks.error();
  const auto dims = logits.dimensions();
  const int64_t rows = dims[0];
  const Tiling t{cluster, threads, units, stages, 0, clusters};
  checks.count("labels", labels.element_count(), rows, "R");
  const int64_t scales = row_scale.element_count();
  checks.require(scales == 1 || scales == rows, [&] {
    return "row_scale has " + std::to_string(scales) + " elements, neither 1 nor R = " +
           std::to_string(rows);
  });
  checks.count("loss", loss->element_count(), rows, "R");
  checks.flag("with_grad", with_grad);
  checks.range("counted", counted, 1, dims[1]);
  checks.require(bias.element_count() == 0 || bias.element_count() == dims[1], [&] {
    return "bias has " + std::to_string(bias.element_count()) + " elements, neither 0 nor N = " +
           std::to_string(dims[1]);
  });
  const DataType grad_type = lse_or_grad->element_type();
  if (with_grad) {
    checks.same_shape("grad", *lse_or_grad, "logits", dims);
    checks.require(grad_type == logits.element_type() ||
                       (logits.element_type() == DataType::F32 &&
                        (grad_type == DataType::BF16 || grad_type == DataType::F16)),
                   [&] {
                     return "grad is " + dtype_name(grad_type) + ", which must match logits (" +
                            dtype_name(logits.element_type()) +
                            "), or be bfloat16 or float16 for float32 logits";
                   });
  } else {
    checks.dtype("lse", lse_or_grad->element_type(), {DataType::F32}, "float32");
    checks.count("lse", lse_or_grad->element_count(), rows, "R");
  }
  checks.require(std::isfinite(smoothing) && smoothing >= 0.f && smoothing < 1.f, [&] {
    return "smoothing=" + std::to_string(smoothing) + " must be in [0, 1)";
  });
  checks.at_least("z_loss", z_loss, 0.f);
  checks.flag("has_ignore", has_ignore);
  checks.range("ignore_index", ignore_index, INT32_MIN, INT32_MAX);
  const bool streaming = units == 0;
  if (streaming) check_streaming_tiling(checks, dims[1], t, kThreads);
  else check_tiling(checks, dims[1], t, kThreads);
  if (!checks.ok()) return checks.error();
  if (rows == 0) return ffi::Error::Success();
  const CrossEntropyArgs args{
      labels.typed_data(), row_scale.typed_data(), scales == 1 ? 0 : 1,
      loss->typed_data(), with_grad ? nullptr : static_cast<float*>(lse_or_grad->untyped_data()),
      smoothing, z_loss, static_cast<int32_t>(ignore_index), has_ignore != 0,
      bias.element_count() ? bias.typed_data() : nullptr, static_cast<int>(counted)};
  cudaError_t err = cudaSuccess;
  auto launch = [&](auto kernel, size_t bytes) {
    err = launch_clustered(kernel, grid_of(t), threads, cluster, bytes, stream,
                           logits.untyped_data(), lse_or_grad->untyped_data(), dims[0],
                           static_cast<int>(dims[1]), args, stages);
  };
  if (streaming) {
    dispatch_float(logits.element_type(), [&](auto type) {
      using T = decltype(type);
      auto stream_into = [&](auto grad_as) {
        using G = decltype(grad_as);
        err = launch_clustered(with_grad ? cross_entropy_streaming_kernel<T, true, G>
                                         : cross_entropy_streaming_kernel<T, false, G>,
                               grid_of(t), threads, 1, 0, stream, logits.untyped_data(),
                               lse_or_grad->untyped_data(), dims[0],
                               static_cast<int>(dims[1]), args);
      };
      if constexpr (std::is_same_v<T, float>) {
        if (with_grad && grad_type != DataType::F32) {
          dispatch_float(grad_type, stream_into);
          return;
        }
      }
      stream_into(T{});
    });
    return launch_error("cross_entropy", err);
  }
  bool known = true;
  if (!with_grad || grad_type == logits.element_type()) {
    known = dispatch_kernel<CrossEntropy, 1, true>(logits.element_type(), with_grad, t, launch);
  } else {
    known &= dispatch_float(grad_type, [&](auto type) {
      using G = decltype(type);
      known &= dispatch_kernel<CrossEntropyInto<G>::template Kernel, 1, true>(
          logits.element_type(), true, t, launch);
    });
  }
  if (!known) return unbuilt("cross_entropy", t, logits);
  return launch_error("cross_entropy", err);
}

}  // namespace
}  // namespace jaxfuse

// These handlers launch only on XLA's stream and allocate nothing, so XLA may capture them
// into the CUDA graphs it runs a jitted program's kernels from.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseSoftmaxForward, jaxfuse::SoftmaxForwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("log")
                                  .Attr<int64_t>("causal_rows")
                                  .Attr<int64_t>("causal_offset")
                                  .Attr<int64_t>("has_mask")
                                  .Attr<xla::ffi::Span<const int64_t>>("mask_sizes")
                                  .Attr<xla::ffi::Span<const int64_t>>("mask_strides")
                                  .Attr<int64_t>("mask_column_stride")
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("clusters"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseSoftmaxBackward, jaxfuse::SoftmaxBackwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("log")
                                  .Attr<int64_t>("causal_rows")
                                  .Attr<int64_t>("causal_offset")
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("clusters"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseCrossEntropy, jaxfuse::CrossEntropyImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::DataType::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::DataType::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::DataType::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::DataType::F32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("smoothing")
                                  .Attr<float>("z_loss")
                                  .Attr<int64_t>("ignore_index")
                                  .Attr<int64_t>("has_ignore")
                                  .Attr<int64_t>("with_grad")
                                  .Attr<int64_t>("counted")
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("clusters"),
    {xla::ffi::Traits::kCmdBufferCompatible});

// For the Python side, which sizes the persistent grids at trace time: clusters of this tiling
// resident on the current GPU at once (kernel 0: forward, 1: backward, 2: cross-entropy).
// Residency depends on registers and shared memory, the same for every dtype of equal width.
extern "C" int jaxfuse_softmax_clusters(int kernel, int itemsize, int flag, int cluster,
                                        int threads, int units, int stages) {
  using namespace jaxfuse;
  int clusters = 0;
  auto query = [&](auto k, size_t bytes) {
    clusters = max_active_clusters(k, threads, cluster, bytes);
  };
  const ffi::DataType dtype = itemsize == 4 ? ffi::DataType::F32 : ffi::DataType::BF16;
  const Tiling t{cluster, threads, units, stages, 0, 1};
  if (kernel == 0) dispatch_kernel<Forward, 1, true>(dtype, flag, t, query);
  else if (kernel == 1) dispatch_kernel<Backward, 2, false>(dtype, flag, t, query);
  else dispatch_kernel<CrossEntropy, 1, true>(dtype, flag, t, query);
  return clusters;
}
