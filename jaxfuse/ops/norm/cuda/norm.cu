// RMSNorm and LayerNorm, each row held in registers: a long row in one thread-block cluster
// (see rows.cuh), a short one in a group of a warp's lanes. The forward reads x once and writes
// y once, the backward reads x and dy once and writes dx once, where a single Pallas program
// must walk long rows twice.
//
// The cluster kernels are persistent: cluster c walks rows c, c + clusters, ... of every group, and
// loads its next row before it reduces the current one, so each CTA keeps a row's loads in
// flight through its reduction, cluster barrier and stores. The next row waits in registers,
// or for the forward's longest rows in a shared-memory stage (cp.async), which leaves the
// registers free to hold twice as wide a slice of the current one. Per-thread state that lives
// for a whole group (the parameter slices, the backward's weight-gradient sums) sits in shared
// memory, leaving the registers to the rows: two 512-thread CTAs fit an SM. A LayerNorm
// backward of a row one CTA of at most 256 threads holds keeps that state in registers instead.
//
// Rows of at most 32 lanes' units go to the short-row kernels below instead, where a group of
// lanes holds a row and a CTA many rows: a cluster kernel would give such a row a whole CTA and
// a barrier. Their grid's second dimension spreads the parameter groups (vmapped weights, or
// the per-example gradients of a vmapped backward), whose rows may be few.
#include <algorithm>

#include "rows.cuh"

namespace jaxfuse {
namespace {

constexpr int kThreads = 512;
// Units per thread the backward is built for: more would spill its two rows' registers.
constexpr int kBackwardUnits = 2;
// 16-byte vectors of x a forward thread holds: through registers, four, so that the next row
// fits beside them; staged through shared memory, at least four (narrower slices gain nothing
// from staging) and at most eight.
constexpr int kRegisterVectors = 4, kMinStagedVectors = 4, kMaxStagedVectors = 8;
// A staged forward CTA has at most 256 threads and is built for three or more to an SM: 80
// registers a thread hold a slice of eight vectors without spilling, and the CTAs' parameter
// slices and stages, not their registers, then bound how many share an SM.
constexpr int kStagedThreads = 256;

// Shared-memory arrays private to each thread, laid out so that a warp's accesses of element
// (k, i) are consecutive words: [(k * width + i) * threads + t].
template <typename V> struct ThreadLocal {
  V* base;
  __device__ __forceinline__ V& at(int k, int i, int width) const {
    return base[(k * width + i) * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)];
  }
};

// Calls f(weighted, biased) for the parameters present, each a std::bool_constant: the
// per-element code then tests neither, nor multiplies by a stand-in one or adds a zero. An
// RMSNorm (kLayer false) has no bias (the FFI handlers refuse one). Without kSpecialize, one
// body takes them as bools, absent ones standing in as ones and zeros: where four bodies
// would spill (cluster backward, staged forward).
template <bool kLayer, bool kSpecialize, typename F>
__device__ __forceinline__ void with_params(bool has_weight, bool has_bias, F&& f) {
  if constexpr (!kSpecialize) {
    f(has_weight, has_bias);
    return;
  }
  auto with_bias = [&](auto weighted) {
    if constexpr (kLayer) {
      if (has_bias) f(weighted, std::true_type{});
      else f(weighted, std::false_type{});
    } else {
      f(weighted, std::false_type{});
    }
  };
  if (has_weight) with_bias(std::true_type{});
  else with_bias(std::false_type{});
}

// A with_params flag's value: a constant for a std::bool_constant.
template <typename Flag> __device__ __forceinline__ constexpr bool on(Flag flag) {
  if constexpr (std::is_same_v<Flag, bool>) return flag;
  else return Flag::value;
}

// Whether a thread computes unit k of y: where it holds it, or for a float32 y where its lane
// pair does (store_paired's exchange takes both lanes).
template <typename TY, typename Slice>
__device__ __forceinline__ bool computes_output(const Slice& slice, int k) {
  return Unit<TY>::kVectors == 2 ? slice.pair_holds(k) : slice.holds(k);
}

// Stores one unit of y (store_paired: where `held`, lane pairs exchanging halves where
// `paired`), (x - mean) * rstd times the weight plus the bias of those present (flags as
// with_params passes them), whose slices of the unit get_weight and get_bias fill.
template <typename TX, typename TY, typename W, typename B, typename GetWeight, typename GetBias>
__device__ __forceinline__ void store_normalized(const Unit<TX>& x, float mean, float rstd,
                                                 W weighted, B biased, GetWeight get_weight,
                                                 GetBias get_bias, TY* out, bool held,
                                                 bool paired) {
  float v[kUnit], w[kUnit], b[kUnit];
  x.unpack(v);
  if (on(weighted)) get_weight(w); else fill(w, 1.f);
  if (on(biased)) get_bias(b); else fill(b, 0.f);
#pragma unroll
  for (int e = 0; e < kUnit; ++e) {
    const float x_hat = (v[e] - mean) * rstd;
    if constexpr (std::is_same_v<W, bool> || std::is_same_v<B, bool>) v[e] = x_hat * w[e] + b[e];
    else if constexpr (W::value && B::value) v[e] = x_hat * w[e] + b[e];
    else if constexpr (W::value) v[e] = x_hat * w[e];
    else if constexpr (B::value) v[e] = x_hat + b[e];
    else v[e] = x_hat;
  }
  Unit<TY> y;
  y.pack(v);
  store_paired(y, out, held, paired);
}

// A parameter unit in its storage type, kept as uint4 words in shared memory.
template <typename TP> struct ParamSlice {
  ThreadLocal<uint4> words;
  __device__ __forceinline__ void load(const TP* row, const RowSlice& slice, int units) const {
    for (int k = 0; k < units; ++k) {
      if (!slice.holds(k)) continue;
      const uint4* src = reinterpret_cast<const uint4*>(row + slice.column(k));
#pragma unroll
      for (int i = 0; i < Unit<TP>::kVectors; ++i)
        words.at(k, i, Unit<TP>::kVectors) = __ldg(src + i);
    }
  }
  __device__ __forceinline__ void get(int k, float (&out)[kUnit]) const {
    Unit<TP> u;
#pragma unroll
    for (int i = 0; i < Unit<TP>::kVectors; ++i) u.raw[i] = words.at(k, i, Unit<TP>::kVectors);
    u.unpack(out);
  }
};

// A thread's float32 sums of one value per row element it owns, two float4 words per unit.
struct UnitSums {
  ThreadLocal<float4> words;
  __device__ __forceinline__ void zero(int k) const {
    words.at(k, 0, 2) = make_float4(0.f, 0.f, 0.f, 0.f);
    words.at(k, 1, 2) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __device__ __forceinline__ void add(int k, const float (&v)[kUnit]) const {
    float4& a = words.at(k, 0, 2);
    float4& b = words.at(k, 1, 2);
    a = make_float4(a.x + v[0], a.y + v[1], a.z + v[2], a.w + v[3]);
    b = make_float4(b.x + v[4], b.y + v[5], b.z + v[6], b.w + v[7]);
  }
  __device__ __forceinline__ void get(int k, float (&out)[kUnit]) const {
    const float4 a = words.at(k, 0, 2), b = words.at(k, 1, 2);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  }
};

template <typename TX, typename TY, typename TP, bool kLayer, int V, bool kStaged,
          bool kClusters>
__global__ void __launch_bounds__(kStaged ? kStagedThreads : kThreads, kStaged ? 3 : 2)
    norm_forward_kernel(const TX* __restrict__ x, const TP* __restrict__ weight,
                        const TP* __restrict__ bias, TY* __restrict__ y,
                        float* __restrict__ mean_out, float* __restrict__ rstd_out,
                        int64_t groups, int64_t rows_per_group, int n, float eps,
                        bool has_weight, bool has_bias, int stages) {
  using Stat = std::conditional_t<kLayer, float3, float>;
  __shared__ ClusterScratch<Stat> scratch;
  extern __shared__ uint4 shared[];
  const int param_words = V * Unit<TP>::kVectors * blockDim.x;
  const ParamSlice<TP> w_slice{{shared}}, b_slice{{shared + (has_weight ? param_words : 0)}};
  uint4* staging = shared + (has_weight + has_bias) * param_words;
  const RowWalk walk = RowWalk::of_cluster<kClusters>();
  const RowSlice slice = RowSlice::mine<kClusters>(V, n);
  const bool leader = ClusterOf<kClusters>().block_rank() == 0 && threadIdx.x == 0;
  int parity = 0;

  for (int64_t group = 0; group < groups; ++group) {
    if (has_weight) w_slice.load(weight + group * n, slice, V);
    if (has_bias) b_slice.load(bias + group * n, slice, V);
    auto xs = feed_of<RowFeed<TX, V, kStaged, 1, WholeRows, true, Reuse::kAgain>>(
        x + group * rows_per_group * n, rows_per_group, n, walk, slice, staging, stages);
    xs.start();
    // Stepped once a row, as the feed's row start, not rebuilt at each unit's store.
    TY* y_row = y + (group * rows_per_group + walk.first) * n;
    const int64_t y_step = walk.step * n;
    int64_t i = 0;
    for (int64_t r = walk.first; r < rows_per_group; r += walk.step, ++i, y_row += y_step) {
      xs.load(i);
      Stat partial;
      if constexpr (kLayer) {
        // This thread's own mean and M2, exactly, in two passes over its registers.
        float sum = 0.f, count = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float v[kUnit];
          xs.now[k].unpack(v);
          sum += unit_sum([&](int e) { return v[e]; });
          count += slice.holds(k) ? kUnit : 0;
        }
        const float mean = count > 0.f ? __fdividef(sum, count) : 0.f;
        float m2 = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (!slice.holds(k)) continue;
          float v[kUnit];
          xs.now[k].unpack(v);
          m2 += unit_sum([&](int e) { return (v[e] - mean) * (v[e] - mean); });
        }
        partial = make_float3(count, mean, m2);
      } else {
        partial = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float v[kUnit];
          xs.now[k].unpack(v);
          partial += unit_sum([&](int e) { return v[e] * v[e]; });
        }
      }
      xs.refill(i);
      Stat total;
      if constexpr (kLayer) total = cluster_moments<kClusters>(partial, scratch, parity);
      else total = cluster_reduce<kClusters>(partial, 0.f, Sum{}, scratch, parity);
      parity ^= 1;
      float mean = 0.f, rstd;
      if constexpr (kLayer) {
        mean = total.y;
        rstd = rsqrtf(total.z / n + eps);
      } else {
        rstd = rsqrtf(total / n + eps);
      }

      const int64_t row = group * rows_per_group + r;
      with_params<kLayer, !kStaged>(has_weight, has_bias, [&](auto weighted, auto biased) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (!computes_output<TY>(slice, k)) continue;
          store_normalized(
              xs.now[k], mean, rstd, weighted, biased,
              [&](float (&w)[kUnit]) { w_slice.get(k, w); },
              [&](float (&b)[kUnit]) { b_slice.get(k, b); }, y_row + slice.column(k),
              slice.holds(k), true);
        }
      });
      if (leader) {
        if (kLayer) mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
    }
  }
}

// The backward's arithmetic, shared by the cluster and short-row kernels: this thread's part
// of a row's sums of w * dy (LayerNorm) and of x_hat * w * dy over the units it holds, where
// weight_of(k, w) gives unit k's weights ...
template <bool kLayer, typename TX, typename TDY, int V, typename Slice, typename WeightOf>
__device__ __forceinline__ float2 thread_row_sums(const Unit<TX> (&xs)[V],
                                                  const Unit<TDY> (&dys)[V], const Slice& slice,
                                                  WeightOf weight_of, float mean, float rstd) {
  float2 partial = make_float2(0.f, 0.f);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (!slice.holds(k)) continue;
    float x[kUnit], dy[kUnit], w[kUnit];
    xs[k].unpack(x);
    dys[k].unpack(dy);
    weight_of(k, w);
    if (kLayer) partial.x += unit_sum([&](int e) { return dy[e] * w[e]; });
    partial.y += unit_sum([&](int e) { return dy[e] * w[e] * (x[e] - mean) * rstd; });
  }
  return partial;
}

// ... and, for one unit, from the row's c1 and c2 (those sums over n), dx in place of x, with
// the dweight terms dy * x_hat added to dw.
__device__ __forceinline__ void unit_gradients(float (&x)[kUnit], const float (&dy)[kUnit],
                                               const float (&w)[kUnit], float mean, float rstd,
                                               float c1, float c2, float (&dw)[kUnit]) {
#pragma unroll
  for (int e = 0; e < kUnit; ++e) {
    const float x_hat = (x[e] - mean) * rstd;
    dw[e] += dy[e] * x_hat;
    x[e] = rstd * (dy[e] * w[e] - c1 - x_hat * c2);
  }
}

// LayerNorm's arithmetic in two passes, each unit unpacked once, for a kernel that holds a
// row's float32 terms and the parameter sums in registers. Pass one keeps x_hat and w * dy for
// pass two, adds dy * x_hat and dy to the parameter sums (flags as with_params passes them),
// and returns this thread's part of the row's sums of w * dy and of x_hat * w * dy.
template <typename TX, typename TDY, typename TP, int V, typename Slice, typename W, typename B>
__device__ __forceinline__ float2 layer_backward_pass_one(
    const Unit<TX> (&xs)[V], const Unit<TDY> (&dys)[V], const Unit<TP> (&w)[V],
    const Slice& slice, W weighted, B biased, float mean, float rstd, float (&x_hat)[V][kUnit],
    float (&wdy)[V][kUnit], float (&dw)[V][kUnit], float (&db)[V][kUnit]) {
  float2 partial = make_float2(0.f, 0.f);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (!slice.holds(k)) continue;
    float xv[kUnit], dyv[kUnit], wv[kUnit];
    xs[k].unpack(xv);
    dys[k].unpack(dyv);
    if (on(weighted)) w[k].unpack(wv); else fill(wv, 1.f);
#pragma unroll
    for (int e = 0; e < kUnit; ++e) {
      x_hat[k][e] = (xv[e] - mean) * rstd;
      wdy[k][e] = wv[e] * dyv[e];
      if (on(weighted)) dw[k][e] = fmaf(dyv[e], x_hat[k][e], dw[k][e]);
      if (on(biased)) db[k][e] += dyv[e];
    }
    partial.x += unit_sum([&](int e) { return wdy[k][e]; });
    partial.y += unit_sum([&](int e) { return wdy[k][e] * x_hat[k][e]; });
  }
  return partial;
}

// ... and pass two, for one unit: dx = rstd * (w * dy - c1 - x_hat * c2), from the row's c1
// and c2 (those sums over n).
__device__ __forceinline__ void layer_backward_pass_two(const float (&x_hat)[kUnit],
                                                        const float (&wdy)[kUnit], float rstd,
                                                        float c1, float c2, float (&dx)[kUnit]) {
  const float k1 = -c1 * rstd, k2 = -c2 * rstd;
#pragma unroll
  for (int e = 0; e < kUnit; ++e) dx[e] = fmaf(wdy[e], rstd, fmaf(x_hat[e], k2, k1));
}

// Each CTA owns one column slice of every row its cluster walks, so it sums its slice of
// dweight and dbias over those rows and writes one float32 partial per (group, cluster);
// sum_partials_kernel then sums them in a fixed order, so the gradients are deterministic.
template <typename TX, typename TDY, typename TP, bool kLayer, int V, bool kClusters>
__global__ void __launch_bounds__(kThreads, 2) norm_backward_kernel(
    const TDY* __restrict__ dy, const TX* __restrict__ x, const TP* __restrict__ weight,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in, TX* __restrict__ dx,
    float* __restrict__ dweight_partial, float* __restrict__ dbias_partial, int64_t groups,
    int64_t rows_per_group, int n, bool has_weight, bool has_bias) {
  let_next_kernel_launch();  // the partials' sum (launch_early) may take spare room now
  __shared__ ClusterScratch<float2> scratch;
  extern __shared__ uint4 shared[];
  const int param_words = V * Unit<TP>::kVectors * blockDim.x;
  const ParamSlice<TP> w_slice{{shared}};
  const UnitSums dw_sum{{reinterpret_cast<float4*>(shared + (has_weight ? param_words : 0))}};
  const UnitSums db_sum{{dw_sum.words.base + (has_weight ? V * 2 * blockDim.x : 0)}};
  const ClusterOf<kClusters> cluster;
  const int64_t clusters = gridDim.x / cluster.num_blocks();
  const int64_t me = blockIdx.x / cluster.num_blocks();
  const RowSlice slice = RowSlice::mine<kClusters>(V, n);
  const float inv_n = 1.f / n;
  int parity = 0;

  for (int64_t group = 0; group < groups; ++group) {
    if (has_weight) w_slice.load(weight + group * n, slice, V);
    for (int k = 0; k < V; ++k) {
      if (has_weight) dw_sum.zero(k);
      if (has_bias) db_sum.zero(k);
    }
    const int64_t group_offset = group * rows_per_group * n;
    Unit<TX> xs[V], next_xs[V];
    Unit<TDY> dys[V], next_dys[V];
    load_row(x + group_offset + me * n, slice, me < rows_per_group, xs);
    load_row(dy + group_offset + me * n, slice, me < rows_per_group, dys);
    with_params<kLayer, !kClusters>(has_weight, has_bias, [&](auto weighted, auto biased) {
      // Ones for an absent weight, which the products fold away where it is a constant.
      auto weight_of = [&](int k, float (&w)[kUnit]) {
        if (on(weighted)) w_slice.get(k, w); else fill(w, 1.f);
      };
      for (int64_t r = me; r < rows_per_group; r += clusters) {
        const int64_t row = group * rows_per_group + r;
        const bool more = r + clusters < rows_per_group;
        load_row(x + group_offset + (r + clusters) * n, slice, more, next_xs);
        load_row(dy + group_offset + (r + clusters) * n, slice, more, next_dys);
        const float mean = kLayer ? mean_in[row] : 0.f, rstd = rstd_in[row];
        const float2 partial = thread_row_sums<kLayer>(xs, dys, slice, weight_of, mean, rstd);
        const float2 total =
            cluster_reduce<kClusters>(partial, make_float2(0.f, 0.f), Sum{}, scratch, parity);
        parity ^= 1;
        const float c1 = kLayer ? total.x * inv_n : 0.f, c2 = total.y * inv_n;
        TX* const dx_row = dx + row * n;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (!slice.holds(k)) continue;
          float xv[kUnit], dyv[kUnit], w[kUnit], dw[kUnit];
          xs[k].unpack(xv);
          dys[k].unpack(dyv);
          weight_of(k, w);
          fill(dw, 0.f);
          unit_gradients(xv, dyv, w, mean, rstd, c1, c2, dw);
          if (on(weighted)) dw_sum.add(k, dw);
          if (on(biased)) db_sum.add(k, dyv);
          Unit<TX> out;
          out.pack(xv);
          out.store_streaming(dx_row + slice.column(k));
        }
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xs[k] = next_xs[k];
          dys[k] = next_dys[k];
        }
      }
    });
    const int64_t partial_row = (group * clusters + me) * n;
    for (int k = 0; k < V; ++k) {
      if (!slice.holds(k)) continue;
      float sums[kUnit];
      if (has_weight) {
        dw_sum.get(k, sums);
        store_float_unit(dweight_partial + partial_row + slice.column(k), sums);
      }
      if (has_bias) {
        db_sum.get(k, sums);
        store_float_unit(dbias_partial + partial_row + slice.column(k), sums);
      }
    }
  }
}

// A LayerNorm row in one CTA of at most kHeldThreads threads: the weight slice and both
// parameter sums sit in registers beside the row (two CTAs an SM), and each unit is unpacked
// once a row. The kernel above keeps them in shared memory, which leaves it the registers of
// four CTAs an SM and of 512-thread CTAs. A row's x and dy registers take the next row's loads
// once pass one has read them, in flight through the row's reduction, pass two and stores.
constexpr int kHeldThreads = 256;

template <typename TX, typename TDY, typename TP, int V>
__global__ void __launch_bounds__(kHeldThreads, 2) layer_norm_backward_held_kernel(
    const TDY* __restrict__ dy, const TX* __restrict__ x, const TP* __restrict__ weight,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in, TX* __restrict__ dx,
    float* __restrict__ dweight_partial, float* __restrict__ dbias_partial, int64_t groups,
    int64_t rows_per_group, int n, bool has_weight, bool has_bias) {
  let_next_kernel_launch();  // the partials' sum (launch_early) may take spare room now
  __shared__ ClusterScratch<float2> scratch;
  const int64_t ctas = gridDim.x, me = blockIdx.x;
  const RowSlice slice = RowSlice::mine<false>(V, n);
  const float inv_n = 1.f / n;
  int parity = 0;
  with_params<true, true>(has_weight, has_bias, [&](auto weighted, auto biased) {
    for (int64_t group = 0; group < groups; ++group) {
      Unit<TP> w[V];
      if (on(weighted)) load_row(weight + group * n, slice, true, w);
      float dw[V][kUnit], db[V][kUnit];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        fill(dw[k], 0.f);
        fill(db[k], 0.f);
      }
      const int64_t offset = group * rows_per_group;
      Unit<TX> xs[V];
      Unit<TDY> dys[V];
      load_row(x + (offset + me) * n, slice, me < rows_per_group, xs);
      load_row(dy + (offset + me) * n, slice, me < rows_per_group, dys);
      for (int64_t r = me; r < rows_per_group; r += ctas) {
        const int64_t row = offset + r;
        const float mean = mean_in[row], rstd = rstd_in[row];
        float x_hat[V][kUnit], wdy[V][kUnit];
        const float2 partial = layer_backward_pass_one(xs, dys, w, slice, weighted, biased, mean,
                                                       rstd, x_hat, wdy, dw, db);
        const bool more = r + ctas < rows_per_group;
        load_row(x + (row + ctas) * n, slice, more, xs);
        load_row(dy + (row + ctas) * n, slice, more, dys);
        const float2 total =
            cluster_reduce<false>(partial, make_float2(0.f, 0.f), Sum{}, scratch, parity);
        parity ^= 1;
        TX* const dx_row = dx + row * n;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (!slice.holds(k)) continue;
          float out[kUnit];
          layer_backward_pass_two(x_hat[k], wdy[k], rstd, total.x * inv_n, total.y * inv_n,
                                  out);
          Unit<TX> unit;
          unit.pack(out);
          unit.store_streaming(dx_row + slice.column(k));
        }
      }
      const int64_t partial_row = (group * ctas + me) * n;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (!slice.holds(k)) continue;
        if (on(weighted)) store_float_unit(dweight_partial + partial_row + slice.column(k), dw[k]);
        if (on(biased)) store_float_unit(dbias_partial + partial_row + slice.column(k), db[k]);
      }
    }
  });
}

// ---- Short rows (rows.cuh LaneSlice): a group of lanes holds a row, a CTA many rows.
//
// Each thread keeps its parameters in registers for the whole group and loads the next row it
// walks while it works on the current one; a row's statistics are shuffles within its group.
// A group past the last row computes on zeros and stores nothing, so that its warp's shuffles
// stay whole.
constexpr int kShortThreads = 256;

template <typename TX, typename TY, typename TP, bool kLayer, int V>
__global__ void __launch_bounds__(kShortThreads)
    norm_forward_short_kernel(const TX* __restrict__ x, const TP* __restrict__ weight,
                              const TP* __restrict__ bias, TY* __restrict__ y,
                              float* __restrict__ mean_out, float* __restrict__ rstd_out,
                              int64_t groups, int64_t rows_per_group, int n, float eps,
                              bool has_weight, bool has_bias, int lanes) {
  const LaneSlice slice = LaneSlice::mine(lanes, n);
  const RowWalk walk = RowWalk::of_lanes(lanes);
  // Rows of one warp differ by its groups' places in it; the warp walks while any is a row.
  const int64_t place = (threadIdx.x % 32) >> (__ffs(lanes) - 1);
  const int64_t stride = walk.step * n;
  const float inv_n = 1.f / n;
  with_params<kLayer, true>(has_weight, has_bias, [&](auto weighted, auto biased) {
    constexpr bool kWeighted = decltype(weighted)::value, kBiased = decltype(biased)::value;
    for (int64_t group = blockIdx.y; group < groups; group += gridDim.y) {
      // Every group has the same rows: a warp without one in this group has none in any.
      if (walk.first - place >= rows_per_group) break;
      Unit<TP> w[V], b[V];
      if constexpr (kWeighted) load_row(weight + group * n, slice, true, w);
      if constexpr (kBiased) load_row(bias + group * n, slice, true, b);
      // Pointers stepped once a row: the loads and stores then add constant unit offsets to
      // them, where `base + row * n` would be a 64-bit product a unit.
      const int64_t first = group * rows_per_group + walk.first;
      const TX* x_row = x + first * n;
      TY* y_row = y + first * n;
      float* mean_at = mean_out + first;
      float* rstd_at = rstd_out + first;
      int64_t r = walk.first;
      // Normalizes row r from xs while the next row it walks loads into `next`; returns
      // whether the warp walks on.
      auto row = [&](Unit<TX>(&xs)[V], Unit<TX>(&next)[V]) {
        load_row<Reuse::kAgain>(x_row + stride, slice, r + walk.step < rows_per_group, next);
        x_row += stride;
        // LayerNorm: the mean, then M2 about it, both exact over the row in registers.
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          float v[kUnit];
          xs[k].unpack(v);
          sum += unit_sum([&](int e) { return kLayer ? v[e] : v[e] * v[e]; });
        }
        sum = lane_group_sum(sum, lanes);
        float mean = 0.f, square = sum;
        if constexpr (kLayer) {
          mean = sum * inv_n;
          square = 0.f;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            if (!slice.holds(k)) continue;
            float v[kUnit];
            xs[k].unpack(v);
            square += unit_sum([&](int e) { return (v[e] - mean) * (v[e] - mean); });
          }
          square = lane_group_sum(square, lanes);
        }
        const float rstd = rsqrtf(square * inv_n + eps);
        if (r < rows_per_group) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            if (!computes_output<TY>(slice, k)) continue;
            store_normalized(
                xs[k], mean, rstd, weighted, biased, [&](float (&wv)[kUnit]) { w[k].unpack(wv); },
                [&](float (&bv)[kUnit]) { b[k].unpack(bv); }, y_row + slice.column(k),
                slice.holds(k), lanes > 1);
          }
          if (slice.lane == 0) {
            if (kLayer) *mean_at = mean;
            *rstd_at = rstd;
          }
        }
        y_row += stride;
        mean_at += walk.step;
        rstd_at += walk.step;
        r += walk.step;
        return r - place < rows_per_group;
      };
      Unit<TX> xs[V], next[V];
      load_row<Reuse::kAgain>(x_row, slice, r < rows_per_group, next);
      do {
#pragma unroll
        for (int k = 0; k < V; ++k) xs[k] = next[k];
      } while (row(xs, next));
    }
  });
}

// Each thread sums dweight and dbias over the rows its group walks, in registers; at the end
// of a parameter group the CTA adds its groups' sums in a fixed order through shared memory and
// writes one float32 partial per (group, CTA), which sum_partials_kernel then sums in a fixed
// order: the gradients are deterministic.
template <typename TX, typename TDY, typename TP, bool kLayer, int V>
__global__ void __launch_bounds__(kShortThreads) norm_backward_short_kernel(
    const TDY* __restrict__ dy, const TX* __restrict__ x, const TP* __restrict__ weight,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in, TX* __restrict__ dx,
    float* __restrict__ dweight_partial, float* __restrict__ dbias_partial, int64_t groups,
    int64_t rows_per_group, int n, bool has_weight, bool has_bias, int lanes) {
  let_next_kernel_launch();  // the partials' sum (launch_early) may take spare room now
  extern __shared__ float4 group_sums[];  // [CTA's lane group][its row's columns]
  const LaneSlice slice = LaneSlice::mine(lanes, n);
  const RowWalk walk = RowWalk::of_lanes(lanes);
  const int shift = __ffs(lanes) - 1;
  const int64_t place = (threadIdx.x % 32) >> shift;
  const int lane_groups = blockDim.x >> shift, width = V * lanes * kUnit;
  float4* my_sums = group_sums + (threadIdx.x >> shift) * (width / 4);
  const int64_t stride = walk.step * n;
  const float inv_n = 1.f / n;
  with_params<kLayer, true>(has_weight, has_bias, [&](auto weighted, auto biased) {
    constexpr bool kWeighted = decltype(weighted)::value, kBiased = decltype(biased)::value;
    for (int64_t group = blockIdx.y; group < groups; group += gridDim.y) {
      Unit<TP> w[V];
      if constexpr (kWeighted) load_row(weight + group * n, slice, true, w);
      // A constant one for an absent weight, which the products fold away.
      auto weight_of = [&](int k, float (&wv)[kUnit]) {
        if constexpr (kWeighted) w[k].unpack(wv);
        else fill(wv, 1.f);
      };
      float dw[V][kUnit], db[V][kUnit];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        fill(dw[k], 0.f);
        fill(db[k], 0.f);
      }
      // Pointers stepped once a row, as in the forward.
      const int64_t first = group * rows_per_group + walk.first;
      const TX* x_next = x + first * n;
      const TDY* dy_next = dy + first * n;
      const float* mean_next = mean_in + first;
      const float* rstd_next = rstd_in + first;
      TX* dx_row = dx + first * n;
      Unit<TX> xs[V], next_xs[V];
      Unit<TDY> dys[V], next_dys[V];
      float mean, rstd, next_mean, next_rstd;
      // Row r and its statistics (zeros past the last row) into the next buffers.
      auto fetch = [&](int64_t r) {
        const bool valid = r < rows_per_group;
        load_row(x_next, slice, valid, next_xs);
        load_row(dy_next, slice, valid, next_dys);
        next_mean = kLayer && valid ? *mean_next : 0.f;
        next_rstd = valid ? *rstd_next : 0.f;
        x_next += stride;
        dy_next += stride;
        mean_next += walk.step;
        rstd_next += walk.step;
      };
      fetch(walk.first);
      for (int64_t r = walk.first; r - place < rows_per_group; r += walk.step, dx_row += stride) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xs[k] = next_xs[k];
          dys[k] = next_dys[k];
        }
        mean = next_mean;
        rstd = next_rstd;
        fetch(r + walk.step);
        // Past the last row x and dy are zeros, which add nothing to the parameter sums.
        const float2 partial = thread_row_sums<kLayer>(xs, dys, slice, weight_of, mean, rstd);
        const float2 total = lane_group_sum(partial, lanes);
        const float c1 = kLayer ? total.x * inv_n : 0.f, c2 = total.y * inv_n;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          if (!slice.holds(k)) continue;
          float xv[kUnit], dyv[kUnit], wv[kUnit];
          xs[k].unpack(xv);
          dys[k].unpack(dyv);
          weight_of(k, wv);
          unit_gradients(xv, dyv, wv, mean, rstd, c1, c2, dw[k]);
          if constexpr (kBiased) {
#pragma unroll
            for (int e = 0; e < kUnit; ++e) db[k][e] += dyv[e];
          }
          if (r < rows_per_group) {
            Unit<TX> out;
            out.pack(xv);
            out.store_streaming(dx_row + slice.column(k));
          }
        }
      }
      const int64_t partial_row = (group * gridDim.x + blockIdx.x) * n;
      auto reduce = [&](const float (&sums)[V][kUnit], float* out) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int unit = slice.column(k) / 4;
          my_sums[unit] = make_float4(sums[k][0], sums[k][1], sums[k][2], sums[k][3]);
          my_sums[unit + 1] = make_float4(sums[k][4], sums[k][5], sums[k][6], sums[k][7]);
        }
        __syncthreads();
        const float* table = reinterpret_cast<const float*>(group_sums);
        for (int c = threadIdx.x; c < n; c += blockDim.x) {
          float total = 0.f;
          for (int g = 0; g < lane_groups; ++g) total += table[g * width + c];
          out[partial_row + c] = total;
        }
        __syncthreads();
      };
      if constexpr (kWeighted) reduce(dw, dweight_partial);
      if constexpr (kBiased) reduce(db, dbias_partial);
    }
  });
}

// ---- Stage two of the parameter gradients: the (G, P, N) float32 partials of each present
// parameter (P: stage one's clusters, or its CTAs for short rows) summed over P into (G, N) of
// the parameter's dtype, rounded once. A CTA takes a strip of columns; its threads split into
// the strip's units (a warp loads whole 32-byte units of a partial row, contiguous across its
// lanes) and `slices` interleaved subsets of the partials, each summed in order and then folded
// pairwise in a fixed tree through shared memory. The order depends on P alone, so every run
// gives the same bits; where P is large and the columns few (short rows), many threads share
// each column's sum and its load latency. Launched early (rows.cuh launch_early) behind stage
// one, whose CTAs let it be scheduled from their start.
constexpr int kSumThreads = 256;
// Slices enough for four partials a thread, up to 64: strips of at least four units, whose
// rows a warp still reads as whole 128-byte lines. Past 256 partials a thread sums more, with
// eight loads in flight at a time, so that the partials of two CTAs an SM (a little over 256)
// arrive in one round trip, not two (benchmarks/results/2026-11-29-h200-norm-cuda-s40-sum1.json
// against -sum0.json).
constexpr int kPartsPerThread = 4, kMaxSumSlices = 64, kSumLoads = 8;

int sum_slices(int64_t parts) {
  int slices = 1;
  while (slices < kMaxSumSlices && slices * kPartsPerThread < parts) slices *= 2;
  return slices;
}

template <typename T>
__device__ __forceinline__ void store_sums(T* out, const float (&sums)[kUnit]) {
  Unit<T> unit;
  unit.pack(sums);
  unit.store_streaming(out);
}

// blockIdx.z picks the parameter: the weight's partials first when it is present.
template <typename TW, typename TB>
__global__ void __launch_bounds__(kSumThreads)
    sum_partials_kernel(const float* __restrict__ partials, TW* __restrict__ dweight,
                        TB* __restrict__ dbias, bool has_weight, int64_t groups, int64_t parts,
                        int n, int slices) {
  wait_for_previous_kernel();
  __shared__ float folded[kUnit * kSumThreads];  // [element of a unit][thread]
  const int strip_units = kSumThreads / slices;
  const int slice = threadIdx.x / strip_units;
  const int column =
      (static_cast<int>(blockIdx.x) * strip_units + static_cast<int>(threadIdx.x) % strip_units) *
      kUnit;
  const bool to_weight = has_weight && blockIdx.z == 0;
  const float* param_partials = partials + blockIdx.z * groups * parts * n;
  for (int64_t group = blockIdx.y; group < groups; group += gridDim.y) {
    float sums[kUnit];
    fill(sums, 0.f);
    if (column < n) {
      const float* first = param_partials + group * parts * n + column;
      // kSumLoads loads in flight at once, added in the order of the partials (zeros past
      // the last add nothing).
      for (int64_t p = slice; p < parts; p += kSumLoads * slices) {
        Unit<float> batch[kSumLoads];
#pragma unroll
        for (int b = 0; b < kSumLoads; ++b) {
          if (p + b * slices < parts) batch[b].load_streaming(first + (p + b * slices) * n);
          else batch[b].zero();
        }
#pragma unroll
        for (int b = 0; b < kSumLoads; ++b) {
          float v[kUnit];
          batch[b].unpack(v);
#pragma unroll
          for (int e = 0; e < kUnit; ++e) sums[e] += v[e];
        }
      }
    }
    for (int half = slices / 2; half > 0; half /= 2) {
      if (slice >= half && slice < 2 * half) {
#pragma unroll
        for (int e = 0; e < kUnit; ++e) folded[e * kSumThreads + threadIdx.x] = sums[e];
      }
      __syncthreads();
      if (slice < half) {
#pragma unroll
        for (int e = 0; e < kUnit; ++e)
          sums[e] += folded[e * kSumThreads + threadIdx.x + half * strip_units];
      }
    }
    // The fold's reads end before the next group's writes.
    __syncthreads();
    if (slice == 0 && column < n) {
      if (to_weight) store_sums(dweight + group * n + column, sums);
      else store_sums(dbias + group * n + column, sums);
    }
  }
}

// Dynamic shared memory of a CTA: the parameter slices (forward, before its stages), or the
// weight slice and the float32 gradient sums (backward); for short rows, the backward's table
// of its lane groups' float32 sums.
size_t forward_smem(int threads, int units, int param_size, bool has_weight, bool has_bias) {
  return static_cast<size_t>(threads) * units * kUnit * param_size * (has_weight + has_bias);
}
size_t backward_smem(int threads, int units, int param_size, bool has_weight, bool has_bias,
                     int lanes) {
  if (lanes > 0) return static_cast<size_t>(threads) * units * kUnit * sizeof(float);
  return static_cast<size_t>(threads) * units * kUnit *
         (param_size * has_weight + sizeof(float) * (has_weight + has_bias));
}

// Short rows hold their row and the next one in registers: at most four 16-byte vectors of x a
// thread (the backward's launch bounds leave it the registers of its two streams and parameter
// sums beside them).
constexpr int kShortForwardVectors = 4, kShortBackwardVectors = 4;

// Calls f(kernel, dynamic shared memory bytes, short_rows) with the forward built for these
// types and `units`: the short-row kernel when lanes > 0 (short_rows a std::true_type), else a
// cluster kernel (of several CTAs or one) fed through registers (stages 0) or `stages`
// shared-memory stages; false when none is built.
template <typename TX, typename TY, typename TP, typename F>
bool dispatch_forward(bool layer, int64_t cluster, int64_t units, int64_t stages, int threads,
                      int lanes, bool has_weight, bool has_bias, F&& f) {
  constexpr int kVectors = Unit<TX>::kVectors;
  bool known = stages >= 0;
  const size_t params = forward_smem(threads, units, sizeof(TP), has_weight, has_bias);
  const bool dispatched = dispatch_units<kMaxStagedVectors / kVectors>(units, [&](auto v) {
    constexpr int V = decltype(v)::value;
    auto with = [&](auto staged, size_t bytes) {
      constexpr bool kStaged = decltype(staged)::value;
      with_clusters(cluster > 1, [&](auto clusters) {
        constexpr bool kClusters = decltype(clusters)::value;
        const std::false_type short_rows;
        if (layer) f(norm_forward_kernel<TX, TY, TP, true, V, kStaged, kClusters>, params + bytes,
                     short_rows);
        else f(norm_forward_kernel<TX, TY, TP, false, V, kStaged, kClusters>, params + bytes,
               short_rows);
      });
    };
    if (lanes > 0) {
      if (stages != 0 || threads > kShortThreads) known = false;
      else if constexpr (V * kVectors <= kShortForwardVectors) {
        if (layer) f(norm_forward_short_kernel<TX, TY, TP, true, V>, 0, std::true_type{});
        else f(norm_forward_short_kernel<TX, TY, TP, false, V>, 0, std::true_type{});
      } else known = false;
    } else if (stages > 0) {
      if (threads > kStagedThreads) known = false;
      else if constexpr (V * kVectors >= kMinStagedVectors)
        with(std::true_type{}, StagedFeed<TX, V>::bytes(static_cast<int>(stages), threads));
      else known = false;
    } else {
      if constexpr (V * kVectors <= kRegisterVectors) with(std::false_type{}, 0);
      else known = false;
    }
  });
  return known && dispatched;
}

// Calls f(kernel, dynamic shared memory bytes, short_rows) with the backward built for these
// types and `units`, for short rows (a std::true_type) when lanes > 0; false when none is
// built. A LayerNorm row in one CTA of at most kHeldThreads takes its held kernel;
// RMSNorm's, with one parameter sum and no mean, ran slower there than in four CTAs an SM
// (benchmarks/results/2026-11-29-h200-norm-cuda-s39-held-a.json against ...-shared-a.json).
template <typename TX, typename TDY, typename TP, typename F>
bool dispatch_backward(bool layer, int64_t cluster, int64_t units, int threads, int lanes,
                       bool has_weight, bool has_bias, F&& f) {
  constexpr int kVectors = Unit<TX>::kVectors;
  bool known = true;
  constexpr int kMaxUnits = std::max(kBackwardUnits, kShortBackwardVectors);
  const size_t smem = backward_smem(threads, static_cast<int>(units), sizeof(TP), has_weight,
                                    has_bias, lanes);
  const bool dispatched = dispatch_units<kMaxUnits>(units, [&](auto v) {
    constexpr int V = decltype(v)::value;
    if (lanes > 0) {
      if (threads > kShortThreads) known = false;
      else if constexpr (V * kVectors <= kShortBackwardVectors) {
        if (layer) f(norm_backward_short_kernel<TX, TDY, TP, true, V>, smem, std::true_type{});
        else f(norm_backward_short_kernel<TX, TDY, TP, false, V>, smem, std::true_type{});
      } else known = false;
    } else if constexpr (V > kBackwardUnits) {
      known = false;
    } else {
      const std::false_type short_rows;
      if (layer && cluster == 1 && threads <= kHeldThreads) {
        f(layer_norm_backward_held_kernel<TX, TDY, TP, V>, 0, short_rows);
        return;
      }
      with_clusters(cluster > 1, [&](auto clusters) {
        constexpr bool kClusters = decltype(clusters)::value;
        if (layer) f(norm_backward_kernel<TX, TDY, TP, true, V, kClusters>, smem, short_rows);
        else f(norm_backward_kernel<TX, TDY, TP, false, V, kClusters>, smem, short_rows);
      });
    }
  });
  return known && dispatched;
}

// The grid: `clusters` clusters along x; for short rows, one row of them per parameter group
// along y, up to CUDA's limit, beyond which a CTA walks every gridDim.y-th group. The Python
// side sizes `clusters` with the same rule (cuda/__init__.py _grid).
constexpr int64_t kMaxGroupBlocks = 65535;
dim3 grid(const Tiling& t, int64_t groups) {
  const int64_t group_blocks = t.lanes > 0 ? std::min(groups, kMaxGroupBlocks) : 1;
  return dim3(static_cast<unsigned>(t.cluster * t.clusters), static_cast<unsigned>(group_blocks),
              1);
}

using ffi::DataType;

// x (G, R, N) of a type the kernels take.
bool check_x(Checks& checks, const ffi::AnyBuffer& x) {
  return checks.rank("x", x, 3, "(G, R, N)") &&
         checks.dtype("x", x.element_type(), {DataType::F32, DataType::BF16, DataType::F16},
                      "float32, bfloat16 or float16");
}

// An operand the kernels never read (an absent parameter, RMSNorm's mean): the Python side
// passes another operand in its place (cuda/__init__.py _params and backward), so it has the
// `own` elements the operand would have, or x's.
void check_stand_in(Checks& checks, const char* name, const ffi::AnyBuffer& buffer, int64_t own,
                    const char* formula, const ffi::AnyBuffer& x) {
  const int64_t count = buffer.element_count(), x_count = x.element_count();
  checks.require(count == own || count == x_count, [&] {
    return std::string(name) + " (unused) has " + std::to_string(count) + " elements, neither " +
           formula + " = " + std::to_string(own) + " nor x's " + std::to_string(x_count);
  });
}

// A parameter operand: of x's dtype or float32 (the weight's, present or not, is the type the
// kernels read parameters as), G * N elements when present.
void check_param(Checks& checks, const char* name, const ffi::AnyBuffer& param, bool present,
                 const ffi::AnyBuffer& x) {
  const auto dims = x.dimensions();
  checks.dtype(name, param.element_type(), {x.element_type(), DataType::F32},
               "x's dtype or float32");
  const int64_t params = product({dims[0], dims[2]});
  if (present) checks.count(name, param.element_count(), params, "G * N");
  else check_stand_in(checks, name, param, params, "G * N", x);
}

// A per-row statistic: float32, G * R elements.
void check_stat(Checks& checks, const char* name, const ffi::AnyBuffer& stat,
                const ffi::AnyBuffer& x) {
  const auto dims = x.dimensions();
  checks.dtype(name, stat.element_type(), {DataType::F32}, "float32");
  checks.count(name, stat.element_count(), product({dims[0], dims[1]}), "G * R");
}

// The kernels specialize RMSNorm (layer=0) for a weight alone.
void check_no_rms_bias(Checks& checks, int64_t layer, int64_t has_bias) {
  checks.require(layer || !has_bias, [] { return std::string("RMSNorm (layer=0) has no bias"); });
}

ffi::Error unbuilt(const char* op, const Tiling& t, const ffi::AnyBuffer& x) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string(op) + ": no kernel is built for " + t.describe() + " over x of " +
                        dtype_name(x.element_type()));
}

ffi::Error NormForwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> mean, ffi::Result<ffi::AnyBuffer> rstd,
                           float eps, int64_t cluster, int64_t threads, int64_t units,
                           int64_t stages, int64_t lanes, int64_t clusters, int64_t layer,
                           int64_t has_weight, int64_t has_bias) {
  Checks checks("norm_forward");
  if (!check_x(checks, x)) return checks.error();
  const auto dims = x.dimensions();
  const Tiling t{cluster, threads, units, stages, lanes, clusters};
  checks.flag("layer", layer);
  checks.flag("has_weight", has_weight);
  checks.flag("has_bias", has_bias);
  checks.same_shape("y", *y, "x", dims);
  checks.dtype("y", y->element_type(), {x.element_type(), DataType::F32}, "x's dtype or float32");
  check_param(checks, "weight", weight, has_weight, x);
  check_param(checks, "bias", bias, has_bias, x);
  // The kernels read both parameters as the weight's type.
  checks.dtype("bias", bias.element_type(), {weight.element_type()}, "weight's dtype");
  check_stat(checks, "mean", *mean, x);
  check_stat(checks, "rstd", *rstd, x);
  checks.at_least("eps", eps, 0.f);
  check_tiling(checks, dims[2], t, kThreads);
  check_no_rms_bias(checks, layer, has_bias);
  if (!checks.ok()) return checks.error();
  if (x.element_count() == 0) return ffi::Error::Success();
  const int n = static_cast<int>(dims[2]);
  cudaError_t err = cudaSuccess;
  bool known = true;
  known &= dispatch_float(x.element_type(), [&](auto tx) {
    using TX = decltype(tx);
    known &= dispatch_same_or_f32<TX>(y->element_type(), [&](auto ty) {
      known &= dispatch_same_or_f32<TX>(weight.element_type(), [&](auto tp) {
        using TY = decltype(ty);
        using TP = decltype(tp);
        known &= dispatch_forward<TX, TY, TP>(
            layer, cluster, units, stages, static_cast<int>(threads), static_cast<int>(lanes),
            has_weight, has_bias, [&](auto kernel, size_t smem, auto short_rows) {
              // The last argument: a short-row kernel's lanes, a cluster kernel's stages.
              err = launch_clustered(
                  kernel, grid(t, dims[0]), threads, cluster, smem, stream,
                  static_cast<const TX*>(x.untyped_data()),
                  static_cast<const TP*>(weight.untyped_data()),
                  static_cast<const TP*>(bias.untyped_data()),
                  static_cast<TY*>(y->untyped_data()), static_cast<float*>(mean->untyped_data()),
                  static_cast<float*>(rstd->untyped_data()), dims[0], dims[1], n, eps,
                  has_weight != 0, has_bias != 0,
                  static_cast<int>(decltype(short_rows)::value ? lanes : stages));
            });
      });
    });
  });
  if (!known) return unbuilt("norm_forward", t, x);
  return launch_error("norm_forward", err);
}

// A parameter's gradient: (G, N) of a float type when present, one unused element when not.
void check_gradient(Checks& checks, const char* name, const ffi::AnyBuffer& grad, bool present,
                    const ffi::AnyBuffer& x) {
  if (!present) {
    checks.require(grad.element_count() == 1, [&] {
      return std::string(name) + " is absent but has " + std::to_string(grad.element_count()) +
             " elements, not 1";
    });
    return;
  }
  const auto dims = x.dimensions();
  checks.dtype(name, grad.element_type(), {DataType::F32, DataType::BF16, DataType::F16},
               "float32, bfloat16 or float16");
  checks.count(name, grad.element_count(), product({dims[0], dims[2]}), "G * N");
}

// Stage one writes each present parameter's float32 partials, (G, clusters, N), into
// `partials`, weight's first; stage two (sum_partials_kernel) sums them into dweight and dbias.
ffi::Error NormBackwardImpl(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                            ffi::AnyBuffer weight, ffi::AnyBuffer mean, ffi::AnyBuffer rstd,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> partials, int64_t cluster,
                            int64_t threads, int64_t units, int64_t lanes, int64_t clusters,
                            int64_t layer, int64_t has_weight, int64_t has_bias) {
  Checks checks("norm_backward");
  if (!check_x(checks, x)) return checks.error();
  const auto dims = x.dimensions();
  const Tiling t{cluster, threads, units, 0, lanes, clusters};
  checks.flag("layer", layer);
  checks.flag("has_weight", has_weight);
  checks.flag("has_bias", has_bias);
  checks.same_shape("dy", dy, "x", dims);
  checks.dtype("dy", dy.element_type(), {x.element_type(), DataType::F32},
               "x's dtype or float32");
  check_param(checks, "weight", weight, has_weight, x);
  if (layer) check_stat(checks, "mean", mean, x);
  else check_stand_in(checks, "mean", mean, product({dims[0], dims[1]}), "G * R", x);
  check_stat(checks, "rstd", rstd, x);
  checks.same_shape("dx", *dx, "x", dims);
  checks.dtype("dx", dx->element_type(), {x.element_type()}, "x's dtype");
  check_gradient(checks, "dweight", *dweight, has_weight, x);
  check_gradient(checks, "dbias", *dbias, has_bias, x);
  if (check_tiling(checks, dims[2], t, kThreads)) {
    const int64_t params = has_weight + has_bias;
    checks.dtype("partials", partials->element_type(), {DataType::F32}, "float32");
    checks.count("partials", partials->element_count(),
                 params ? product({params, dims[0], clusters, dims[2]}) : 1,
                 params ? "parameters * G * clusters * N" : nullptr);
  }
  check_no_rms_bias(checks, layer, has_bias);
  if (!checks.ok()) return checks.error();
  if (dims[0] == 0) return ffi::Error::Success();
  const int n = static_cast<int>(dims[2]);
  float* dweight_partial = static_cast<float*>(partials->untyped_data());
  float* dbias_partial = dweight_partial + (has_weight ? dims[0] * clusters * dims[2] : 0);
  cudaError_t err = cudaSuccess;
  bool known = true;
  known &= dispatch_float(x.element_type(), [&](auto tx) {
    using TX = decltype(tx);
    known &= dispatch_same_or_f32<TX>(dy.element_type(), [&](auto tdy) {
      known &= dispatch_same_or_f32<TX>(weight.element_type(), [&](auto tp) {
        using TDY = decltype(tdy);
        using TP = decltype(tp);
        known &= dispatch_backward<TX, TDY, TP>(
            layer, cluster, units, static_cast<int>(threads), static_cast<int>(lanes),
            has_weight != 0, has_bias != 0, [&](auto kernel, size_t smem, auto short_rows) {
              // A short-row kernel takes its lanes last.
              auto launch = [&](auto... last) {
                err = launch_clustered(
                  kernel, grid(t, dims[0]), threads, cluster, smem, stream,
                  static_cast<const TDY*>(dy.untyped_data()),
                  static_cast<const TX*>(x.untyped_data()),
                  static_cast<const TP*>(weight.untyped_data()),
                  static_cast<const float*>(mean.untyped_data()),
                  static_cast<const float*>(rstd.untyped_data()),
                  static_cast<TX*>(dx->untyped_data()), dweight_partial, dbias_partial, dims[0],
                  dims[1], n, has_weight != 0, has_bias != 0, last...);
              };
              if constexpr (decltype(short_rows)::value) launch(static_cast<int>(lanes));
              else launch();
            });
      });
    });
  });
  if (!known) return unbuilt("norm_backward", t, x);
  if (err != cudaSuccess || !(has_weight || has_bias)) return launch_error("norm_backward", err);

  // An absent gradient's buffer is never written: its type is immaterial.
  const DataType weight_type = has_weight ? dweight->element_type() : DataType::F32;
  const DataType bias_type = has_bias ? dbias->element_type() : DataType::F32;
  const int slices = sum_slices(clusters);
  const int64_t strip = kSumThreads / slices * kUnit;
  const dim3 sum_grid(static_cast<unsigned>((dims[2] + strip - 1) / strip),
                      static_cast<unsigned>(std::min(dims[0], kMaxGroupBlocks)),
                      static_cast<unsigned>(has_weight + has_bias));
  dispatch_float(weight_type, [&](auto tw) {
    dispatch_float(bias_type, [&](auto tb) {
      using TW = decltype(tw);
      using TB = decltype(tb);
      err = launch_early(sum_partials_kernel<TW, TB>, sum_grid, kSumThreads, stream,
                         static_cast<const float*>(dweight_partial),
                         static_cast<TW*>(dweight->untyped_data()),
                         static_cast<TB*>(dbias->untyped_data()), has_weight != 0, dims[0],
                         clusters, n, slices);
    });
  });
  return launch_error("norm_backward (sum of partials)", err);
}

}  // namespace
}  // namespace jaxfuse

// These handlers launch only on XLA's stream and allocate nothing, so XLA may capture them
// into the CUDA graphs it runs a jitted program's kernels from.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseNormForward, jaxfuse::NormForwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("stages")
                                  .Attr<int64_t>("lanes")
                                  .Attr<int64_t>("clusters")
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("has_weight")
                                  .Attr<int64_t>("has_bias"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseNormBackward, jaxfuse::NormBackwardImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("cluster")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("units")
                                  .Attr<int64_t>("lanes")
                                  .Attr<int64_t>("clusters")
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("has_weight")
                                  .Attr<int64_t>("has_bias"),
    {xla::ffi::Traits::kCmdBufferCompatible});

// For the Python side, which sizes the persistent grids (and the backward's partial gradients)
// at trace time: clusters of this shape resident on the current GPU at once. Residency depends
// on registers and shared memory, the same for every dtype of equal width.
extern "C" int jaxfuse_norm_clusters(int backward, int x_itemsize, int other_itemsize,
                                     int param_itemsize, int layer, int cluster, int threads,
                                     int units, int stages, int lanes, int has_weight,
                                     int has_bias) {
  using namespace jaxfuse;
  int clusters = 0;
  auto by_width = [](int itemsize, auto f) {
    if (itemsize == 4) f(float{});
    else f(__nv_bfloat16{});
  };
  by_width(x_itemsize, [&](auto tx) {
    by_width(other_itemsize, [&](auto to) {
      by_width(param_itemsize, [&](auto tp) {
        using TX = decltype(tx);
        using TO = std::conditional_t<sizeof(decltype(to)) == sizeof(TX), TX, float>;
        using TP = std::conditional_t<sizeof(decltype(tp)) == sizeof(TX), TX, float>;
        if (backward) {
          dispatch_backward<TX, TO, TP>(layer, cluster, units, threads, lanes, has_weight,
                                        has_bias, [&](auto kernel, size_t smem, auto) {
            clusters = max_active_clusters(kernel, threads, cluster, smem);
          });
        } else {
          dispatch_forward<TX, TO, TP>(layer, cluster, units, stages, threads, lanes,
                                       has_weight, has_bias, [&](auto kernel, size_t smem, auto) {
            clusters = max_active_clusters(kernel, threads, cluster, smem);
          });
        }
      });
    });
  });
  return clusters;
}
