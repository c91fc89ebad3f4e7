// Row kernels that keep a whole row in registers, split across a thread-block cluster (or, for
// short rows, held by a group of lanes of one warp: LaneSlice below).
//
// A row of N elements is cut into 8-element units. Cluster CTA `rank` of T threads owns the
// slice of V * T units starting at unit rank * V * T; thread t holds units k * T + t (k < V), so
// each warp's loads and stores are contiguous 16-byte vectors. V is a template parameter: every
// per-unit array is indexed statically and stays in registers.
//
// Row statistics are reduced with warp shuffles, then over the CTA's warps, then over the
// cluster: each CTA pushes its partial into a slot of every peer's shared memory (DSMEM) and one
// cluster barrier later every CTA folds the same slots in the same order. So all CTAs see the
// same bits, repeated runs give the same bits, and no CTA touches a peer's shared memory after
// the barrier, so CTAs may exit as soon as they are done.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

namespace cg = cooperative_groups;
namespace ffi = xla::ffi;

// Whether this library is built for thread-block clusters (sm_90 and newer). nvcc's list of
// the architectures it builds (one here) is seen by the host pass too, so a build for an older
// GPU instantiates only the kernels of a CTA alone.
#if !defined(__CUDA_ARCH_LIST__)
#error "jaxfuse's CUDA kernels need nvcc 11.5 or newer, which defines __CUDA_ARCH_LIST__"
#elif __CUDA_ARCH_LIST__ >= 900
constexpr bool kBuiltForClusters = true;
#else
constexpr bool kBuiltForClusters = false;
#endif

// The cluster a CTA runs in. Each kernel is built twice: for clusters of several CTAs
// (kClusters), and for a CTA alone, launched without a cluster, which meets and exchanges
// within itself through __syncthreads and local stores. Built apart, the CTA alone keeps the
// registers the cluster's bookkeeping would take, which in the shared build pushed the widest
// slices into spills; a GPU before sm_90 has only this one.
template <bool kClusters> struct ClusterOf {
  __device__ __forceinline__ unsigned block_rank() const { return 0; }
  __device__ __forceinline__ unsigned num_blocks() const { return 1; }
  template <typename T> __device__ __forceinline__ T* map_shared_rank(T* p, int) const {
    return p;
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
};
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
template <> struct ClusterOf<true> {
  __device__ __forceinline__ unsigned block_rank() const {
    return cg::this_cluster().block_rank();
  }
  __device__ __forceinline__ unsigned num_blocks() const {
    return cg::this_cluster().num_blocks();
  }
  template <typename T> __device__ __forceinline__ T* map_shared_rank(T* p, int rank) const {
    return cg::this_cluster().map_shared_rank(p, rank);
  }
  __device__ __forceinline__ void sync() const { cg::this_cluster().sync(); }
};
#endif

// Calls f(std::bool_constant<kClusters>{}) for a launch in clusters of several CTAs or of one.
template <typename F> __host__ __forceinline__ void with_clusters(bool clustered, F&& f) {
  if constexpr (kBuiltForClusters) {
    if (clustered) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

constexpr int kUnit = 8;
constexpr int kMaxCluster = 16;  // non-portable above 8; an H100 launches up to 16
constexpr int kMaxThreads = 1024;

// ---- Units: 8 elements in storage type, moved as one (2-byte types) or two (float) uint4.

// Whether a kernel's input is read once, or read again soon by another kernel (a norm's x,
// which its backward reads in a training step, while the rows may still be in L2).
enum class Reuse { kOnce, kAgain };

template <typename T> struct Unit {
  static constexpr int kVectors = sizeof(T) * kUnit / 16;
  uint4 raw[kVectors];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) raw[i] = make_uint4(0, 0, 0, 0);
  }
  // Read-once data: streaming loads that do not displace reused lines from L1/L2.
  __device__ __forceinline__ void load_streaming(const T* p) {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) raw[i] = __ldcs(reinterpret_cast<const uint4*>(p) + i);
  }
  // Data read again soon: loads at L2's normal priority, so the lines may still be there.
  __device__ __forceinline__ void load_kept(const T* p) {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
  }
  __device__ __forceinline__ void store_streaming(T* p) const {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) __stcs(reinterpret_cast<uint4*>(p) + i, raw[i]);
  }
  __device__ __forceinline__ void unpack(float (&out)[kUnit]) const;
  __device__ __forceinline__ void pack(const float (&in)[kUnit]);
};

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <> __device__ __forceinline__ void Unit<float>::unpack(float (&out)[kUnit]) const {
#pragma unroll
  for (int i = 0; i < kUnit; ++i) out[i] = __uint_as_float(word(raw[i / 4], i % 4));
}
template <> __device__ __forceinline__ void Unit<float>::pack(const float (&in)[kUnit]) {
  raw[0] = make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  raw[1] = make_uint4(__float_as_uint(in[4]), __float_as_uint(in[5]), __float_as_uint(in[6]),
                      __float_as_uint(in[7]));
}

// bfloat16 is the top half of a float: unpacking is a shift or a mask.
template <> __device__ __forceinline__ void Unit<__nv_bfloat16>::unpack(float (&out)[kUnit]) const {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = word(raw[0], i);
    out[2 * i] = __uint_as_float(w << 16);
    out[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
  }
}
template <> __device__ __forceinline__ void Unit<__nv_bfloat16>::pack(const float (&in)[kUnit]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  raw[0] = make_uint4(w[0], w[1], w[2], w[3]);
}

template <> __device__ __forceinline__ void Unit<__half>::unpack(float (&out)[kUnit]) const {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = word(raw[0], i);
    const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&w));
    out[2 * i] = pair.x;
    out[2 * i + 1] = pair.y;
  }
}
template <> __device__ __forceinline__ void Unit<__half>::pack(const float (&in)[kUnit]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 pair = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  raw[0] = make_uint4(w[0], w[1], w[2], w[3]);
}

// Float32 results of a unit (partial gradient sums) go out as two 16-byte stores.
__device__ __forceinline__ void store_float_unit(float* p, const float (&in)[kUnit]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
}

// The sum of term(0..7) as a tree: a dependency chain of 3 additions instead of 8, so a row's
// reduction waits less on its own arithmetic.
template <typename F> __device__ __forceinline__ float unit_sum(F term) {
  float t[kUnit];
#pragma unroll
  for (int e = 0; e < kUnit; ++e) t[e] = term(e);
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

__device__ __forceinline__ void fill(float (&out)[kUnit], float value) {
#pragma unroll
  for (int i = 0; i < kUnit; ++i) out[i] = value;
}

// Where this thread's units sit in the row: unit k covers [column(k), column(k) + 8).
struct RowSlice {
  int first, threads, n;

  template <bool kClusters>
  __device__ __forceinline__ static RowSlice mine(int units_per_thread, int n) {
    const int rank = static_cast<int>(ClusterOf<kClusters>().block_rank());
    return {rank * units_per_thread * static_cast<int>(blockDim.x) * kUnit,
            static_cast<int>(blockDim.x), n};
  }
  __device__ __forceinline__ int column(int k) const {
    return first + (k * threads + static_cast<int>(threadIdx.x)) * kUnit;
  }
  __device__ __forceinline__ bool holds(int k) const { return column(k) < n; }
  // Whether the even thread of this thread's pair (threadIdx.x ^ 1, the unit beside it) holds
  // unit k: a pair that exchanges halves of its units (store_paired) enters together.
  __device__ __forceinline__ bool pair_holds(int k) const {
    return column(k) - (static_cast<int>(threadIdx.x) & 1) * kUnit < n;
  }
};

// Short rows: a row of at most 32 * V units is held by a group of `lanes` lanes of one warp (a
// power of two), lane j holding units k * lanes + j. A warp holds 32 / lanes rows at once, and a
// row's statistics take a warp's shuffles and no barrier, where a CTA per row would pay a
// barrier and leave most of its threads without work.
struct LaneSlice {
  int lanes, lane, n;

  __device__ __forceinline__ static LaneSlice mine(int lanes, int n) {
    return {lanes, static_cast<int>(threadIdx.x) & (lanes - 1), n};
  }
  __device__ __forceinline__ int column(int k) const { return (k * lanes + lane) * kUnit; }
  __device__ __forceinline__ bool holds(int k) const { return column(k) < n; }
  // As RowSlice's: lanes 2j and 2j + 1 hold adjacent units of one row (a lane alone, lane 0,
  // is its own pair).
  __device__ __forceinline__ bool pair_holds(int k) const {
    return column(k) - (lane & 1) * kUnit < n;
  }
};

// Stores this thread's unit at `out` where it holds it (`held`). A 32-byte unit (float32) is
// two vectors, so a warp storing one vector a lane writes half of every sector, twice; with
// `paired`, lanes 2j and 2j + 1 (adjacent units, both calling while the even one holds its
// unit) first swap halves, so that each store writes one unit's whole sector: the even lane
// the first halves, the odd lane the second ones.
template <typename T>
__device__ __forceinline__ void store_paired(const Unit<T>& unit, T* out, bool held, bool paired) {
  if constexpr (Unit<T>::kVectors == 2) {
    if (paired) {
      const unsigned lane = threadIdx.x % 32, pair = 3u << (lane & ~1u);
      const bool odd = lane & 1;
      const uint4 sent = odd ? unit.raw[0] : unit.raw[1];
      const uint4 got = make_uint4(
          __shfl_xor_sync(pair, sent.x, 1), __shfl_xor_sync(pair, sent.y, 1),
          __shfl_xor_sync(pair, sent.z, 1), __shfl_xor_sync(pair, sent.w, 1));
      const bool partner_held = __shfl_xor_sync(pair, held, 1);
      uint4* const p = reinterpret_cast<uint4*>(out);
      __stcs(odd ? p - 1 : p, odd ? got : unit.raw[0]);
      if (odd ? held : partner_held) __stcs(odd ? p + 1 : p + 2, odd ? unit.raw[1] : got);
      return;
    }
  }
  if (held) unit.store_streaming(out);
}

// A thread's units of one row (zeros for units past the row's end, or for no row at all).
template <Reuse kReuse = Reuse::kOnce, typename T, int V, typename Slice>
__device__ __forceinline__ void load_row(const T* row, const Slice& slice, bool valid,
                                         Unit<T> (&units)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (!valid || !slice.holds(k)) units[k].zero();
    else if constexpr (kReuse == Reuse::kAgain) units[k].load_kept(row + slice.column(k));
    else units[k].load_streaming(row + slice.column(k));
  }
}

// The rows a persistent cluster walks: first, first + step, first + 2 step, ...
struct RowWalk {
  int64_t first, step;

  template <bool kClusters> __device__ __forceinline__ static RowWalk of_cluster() {
    const int64_t ctas = ClusterOf<kClusters>().num_blocks();
    return {blockIdx.x / ctas, gridDim.x / ctas};
  }
  // Short rows: the groups of `lanes` lanes of every CTA, in order, take consecutive rows.
  // `lanes` is a power of two: shifts, not divisions.
  __device__ __forceinline__ static RowWalk of_lanes(int lanes) {
    const int shift = __ffs(lanes) - 1;
    const int64_t per_cta = blockDim.x >> shift;
    return {blockIdx.x * per_cta + (threadIdx.x >> shift), gridDim.x * per_cta};
  }
};

// How a thread's units of each row reach its registers. A kernel walks its rows as
//
//   feed.start();
//   for (i = 0, r = walk.first; r < rows; ++i, r += walk.step) {
//     feed.load(i);    // feed.now: this thread's units of row r
//     ... a reduction that reads every unit of feed.now ...
//     feed.refill(i);  // queue the loads of a later row
//     ... the cluster reduction, the outputs ...
//   }
//
// so loads are in flight through every row's cluster barrier and stores.
//
// Ends gives the column each fetched row's loads stop at, asked once a fetch in row order:
// units from it on are not read (zeros through registers, stale through shared memory), for a
// kernel that masks them. lag(rows) tells it how many rows its fetches run ahead of the row a
// kernel holds, whose end held_end gives.
struct WholeRows {
  __device__ __forceinline__ void lag(int) {}
  __device__ __forceinline__ int next_end(int n) { return n; }
  __device__ __forceinline__ int held_end(int n) const { return n; }
};

// A stepped feed (kStepped) keeps where its next fetch's row starts as a pointer stepped once a
// row, fetches going in row order: the norm forward, held to 64 registers, rebuilt
// `base + r * n` as a 64-bit product under each unit's load predicate. The softmax kernels keep
// the product, which the compiler rematerializes from their parameters: a live pointer made
// them spill more (benchmarks/PERFORMANCE.md, session 40).
template <typename T, typename Ends, bool kStepped> struct FeedBase {
  static constexpr bool kSteppedRows = false;
  const T* base;
  int64_t rows;
  int n;
  RowWalk walk;
  RowSlice slice;
  Ends ends;

  __device__ __forceinline__ int64_t row(int64_t i) const { return walk.first + i * walk.step; }
  // Where row r, the next one fetched, starts.
  __device__ __forceinline__ const T* row_start(int64_t r) const { return base + r * n; }
  // The end of the row of `now`, between a load and the next refill.
  __device__ __forceinline__ int held_end() const { return ends.held_end(n); }
  // The slice of the next fetched row that is read.
  __device__ __forceinline__ RowSlice next_read() {
    RowSlice read = slice;
    read.n = ends.next_end(n);
    return read;
  }
};

template <typename T, typename Ends> struct FeedBase<T, Ends, true> : FeedBase<T, Ends, false> {
  static constexpr bool kSteppedRows = true;
  const T* ahead;
  int64_t ahead_step;

  __device__ __forceinline__ const T* row_start(int64_t) {
    const T* start = ahead;
    ahead += ahead_step;
    return start;
  }
};

// Rows through registers. With kPrefetch a thread loads row i + 1 while it works on row i,
// which doubles its registers; without, the CTAs of other clusters on the SM hide the loads.
template <typename T, int V, bool kPrefetch, typename Ends, bool kStepped = false,
          Reuse kReuse = Reuse::kOnce>
struct RegisterFeed : FeedBase<T, Ends, kStepped> {
  static constexpr bool kStaged = false;
  Unit<T> now[V], next[V];

  __device__ __forceinline__ void start() {
    if constexpr (kPrefetch) fetch(0, next);
  }
  __device__ __forceinline__ void load(int64_t i) {
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < V; ++k) now[k] = next[k];
    } else {
      fetch(i, now);
    }
  }
  __device__ __forceinline__ void refill(int64_t i) {
    if constexpr (kPrefetch) fetch(i + 1, next);
  }

 private:
  __device__ __forceinline__ void fetch(int64_t i, Unit<T> (&units)[V]) {
    const int64_t r = this->row(i);
    load_row<kReuse>(this->row_start(r), this->next_read(), r < this->rows, units);
  }
};

// Copies 16 bytes from global to shared memory asynchronously (cp.async), past L1.
__device__ __forceinline__ void copy_async(uint4* shared, const void* global) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
               : "memory");
}

// Until at most `pending` of this thread's committed copy groups are in flight (the count is
// an immediate in PTX).
__device__ __forceinline__ void wait_copies(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_all;\n" ::: "memory"); break;
  }
}

// Rows staged through shared memory: `stages` rows ahead of the one in registers are in
// flight as cp.async copies, without the registers to hold them, so a CTA keeps several rows'
// loads outstanding at once and its registers hold a wider slice of one row. Each thread copies
// and reads back only its own units, so no barrier guards a stage: cp.async.wait_group makes a
// thread's copies visible to itself, and a stage is refilled only after the reduction has
// consumed every register read from it. Layout: vector j of unit k of stage s of thread t at
// ((s * V + k) * kVectors + j) * threads + t, so a warp's shared accesses are consecutive.
template <typename T, int V, typename Ends = WholeRows, bool kStepped = false>
struct StagedFeed : FeedBase<T, Ends, kStepped> {
  static constexpr bool kStaged = true;
  static constexpr int kVectors = Unit<T>::kVectors;
  Unit<T> now[V];
  uint4* mine;  // this thread's vector 0 of unit 0 of stage 0
  int stages, stage;

  __host__ __device__ __forceinline__ static size_t bytes(int stages, int threads) {
    return static_cast<size_t>(stages) * V * kVectors * threads * sizeof(uint4);
  }

  __device__ __forceinline__ void start() {
    for (int s = 0; s < stages; ++s) {
      copy(s, s);
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
  }
  __device__ __forceinline__ void load(int64_t) {
    wait_copies(stages - 1);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!this->slice.holds(k)) {
        now[k].zero();
        continue;
      }
#pragma unroll
      for (int j = 0; j < kVectors; ++j) now[k].raw[j] = at(stage, k, j);
    }
  }
  __device__ __forceinline__ void refill(int64_t i) {
    copy(i + stages, stage);
    // Committed even when empty, so that row i's copies are always `stages` groups back.
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    stage = stage + 1 == stages ? 0 : stage + 1;
  }

 private:
  __device__ __forceinline__ uint4& at(int s, int k, int j) const {
    return mine[((s * V + k) * kVectors + j) * this->slice.threads];
  }
  __device__ __forceinline__ void copy(int64_t i, int s) {
    const RowSlice read = this->next_read();
    const int64_t r = this->row(i);
    // Rows past the last come only after it: a stepped feed need not step over them.
    if (r >= this->rows) return;
    const T* row = this->row_start(r);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!read.holds(k)) continue;
      const uint4* src = reinterpret_cast<const uint4*>(row + this->slice.column(k));
#pragma unroll
      for (int j = 0; j < kVectors; ++j) copy_async(&at(s, k, j), src + j);
    }
  }
};

// A thread keeps its next row in flight in registers while its slice of the current one takes
// at most four 16-byte vectors over all the streams it reads.
template <typename T, int V, int kStreams>
constexpr bool kPrefetchFits = V * Unit<T>::kVectors * kStreams <= 4;

// Staged copies (cp.async.cg) keep L2's normal priority whatever kReuse says.
template <typename T, int V, bool kStaged, int kStreams, typename Ends = WholeRows,
          bool kStepped = false, Reuse kReuse = Reuse::kOnce>
using RowFeed = std::conditional_t<
    kStaged, StagedFeed<T, V, Ends, kStepped>,
    RegisterFeed<T, V, kPrefetchFits<T, V, kStreams>, Ends, kStepped, kReuse>>;

// A feed of the rows of `base` (rows x n) that this thread's cluster walks; a staged feed uses
// `stages` stages of the CTA's dynamic shared memory from `shared` on.
template <typename Feed, typename T>
__device__ __forceinline__ Feed feed_of(const T* base, int64_t rows, int n, const RowWalk& walk,
                                        const RowSlice& slice, uint4* shared, int stages,
                                        decltype(Feed::ends) ends = {}) {
  Feed feed;
  feed.base = base;
  feed.rows = rows;
  feed.n = n;
  feed.walk = walk;
  feed.slice = slice;
  feed.ends = ends;
  if constexpr (Feed::kSteppedRows) {
    feed.ahead = base + walk.first * n;
    feed.ahead_step = walk.step * n;
  }
  // Between a load and its refill, a staged feed has fetched `stages` rows past the held one,
  // a register feed one.
  feed.ends.lag(Feed::kStaged ? stages : 1);
  if constexpr (Feed::kStaged) {
    feed.mine = shared + threadIdx.x;
    feed.stages = stages;
    feed.stage = 0;
  }
  return feed;
}

// ---- Cluster-wide reduction.

template <typename S> __device__ __forceinline__ S shuffle(S v, int lane_mask, bool xor_mode);
template <> __device__ __forceinline__ float shuffle(float v, int m, bool x) {
  return x ? __shfl_xor_sync(0xffffffffu, v, m) : __shfl_sync(0xffffffffu, v, m);
}
template <> __device__ __forceinline__ float2 shuffle(float2 v, int m, bool x) {
  return make_float2(shuffle(v.x, m, x), shuffle(v.y, m, x));
}
template <> __device__ __forceinline__ float3 shuffle(float3 v, int m, bool x) {
  return make_float3(shuffle(v.x, m, x), shuffle(v.y, m, x), shuffle(v.z, m, x));
}

// Double-buffered by parity: a CTA writes a peer's slot[p] only after the previous reduction's
// barrier, which the peer passes only after folding slot[p ^ 1]; two reductions back, slot[p]
// has been folded too. One cluster barrier per reduction is then enough.
template <typename S> struct ClusterScratch {
  S warp[kMaxThreads / 32];
  S slot[2][kMaxCluster];
};

// A CTA alone of at most this many warps sums their values in every thread, behind one
// barrier; in larger CTAs that fold cost more than warp 0 folding once behind a second barrier
// (benchmarks/results/2026-11-29-h200-without-triton-norm-s40.json folded in every CTA, s40b
// up to this bound).
constexpr int kFoldEverywhereWarps = 4;

// Reduces `value` over all threads of all CTAs of the cluster with `op` (which must accept its
// `identity`); every thread of every CTA returns the same bits.
template <bool kClusters, typename S, typename Op>
__device__ __forceinline__ S cluster_reduce(S value, S identity, Op op,
                                            ClusterScratch<S>& scratch, int parity) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const ClusterOf<kClusters> cluster;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, shuffle(value, offset, true));
  if (!kClusters && warps <= kFoldEverywhereWarps) {
    // The slots that carry a cluster's CTA values carry the warps' here; every thread folds
    // them in one order, so all get the same bits.
    if (lane == 0) scratch.slot[parity][warp] = value;
    __syncthreads();
    S total = scratch.slot[parity][0];
    for (int w = 1; w < warps; ++w) total = op(total, scratch.slot[parity][w]);
    return total;
  }
  if (lane == 0) scratch.warp[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? scratch.warp[lane] : identity;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = op(value, shuffle(value, offset, true));
    // op need not be commutative in rounding: lane 0's result is the CTA's.
    value = shuffle(value, 0, false);
    const int ranks = static_cast<int>(cluster.num_blocks());
    if (lane < ranks)
      *cluster.map_shared_rank(&scratch.slot[parity][cluster.block_rank()], lane) = value;
  }
  cluster.sync();
  S total = scratch.slot[parity][0];
  for (int r = 1; r < static_cast<int>(cluster.num_blocks()); ++r)
    total = op(total, scratch.slot[parity][r]);
  return total;
}

struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  __device__ __forceinline__ float2 operator()(float2 a, float2 b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
  __device__ __forceinline__ float3 operator()(float3 a, float3 b) const {
    return make_float3(a.x + b.x, a.y + b.y, a.z + b.z);
  }
};

// The sum over a group of `lanes` lanes (a power of two, aligned in its warp) as a butterfly:
// every lane of the group gets the same bits. Every lane of the warp must take part.
template <typename S> __device__ __forceinline__ S lane_group_sum(S value, int lanes) {
  // Every width a warp has, unrolled: each step shuffles and keeps the sum where it lies
  // within the group, with neither a loop nor a branch around the shuffles.
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const S summed = Sum{}(value, shuffle(value, offset, true));
    if (offset < lanes) value = summed;
  }
  return value;
}

// Moments (count, mean, M2) of disjoint parts merged exactly: each part's sums of (v - shift)
// and (v - shift)^2 follow from its moments, they add, and the merged moments follow back.
// With the shift a part's mean, close to the merged mean, M2 = S2 - S1^2 / n barely cancels:
// the variance of data with a large mean stays accurate, as a plain sum of squares would not.
__device__ __forceinline__ float3 shifted_sums(float3 moments, float shift) {
  const float d = moments.y - shift;
  return make_float3(moments.x, moments.x * d, moments.z + moments.x * d * d);
}
__device__ __forceinline__ float3 moments_of(float3 sums, float shift) {
  const float per = sums.x > 0.f ? __fdividef(sums.y, sums.x) : 0.f;
  return make_float3(sums.x, shift + per, sums.z - sums.y * per);
}

// Merges every thread's moments over the cluster, shifting by one part's mean at each level (a
// warp's lane 0, the CTA's warp 0, the cluster's CTA 0); every thread returns the same bits.
template <bool kClusters>
__device__ __forceinline__ float3 cluster_moments(float3 moments, ClusterScratch<float3>& scratch,
                                                  int parity) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const ClusterOf<kClusters> cluster;
  auto merge_warp = [&](float3 m) {
    const float shift = __shfl_sync(0xffffffffu, m.y, 0);
    float3 sums = shifted_sums(m, shift);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      sums = Sum{}(sums, shuffle(sums, offset, true));
    return moments_of(sums, shift);
  };
  moments = merge_warp(moments);
  if (lane == 0) scratch.warp[warp] = moments;
  __syncthreads();
  if (warp == 0) {
    moments = merge_warp(lane < warps ? scratch.warp[lane] : make_float3(0.f, 0.f, 0.f));
    const int ranks = static_cast<int>(cluster.num_blocks());
    if (lane < ranks)
      *cluster.map_shared_rank(&scratch.slot[parity][cluster.block_rank()], lane) = moments;
  }
  cluster.sync();
  const float shift = scratch.slot[parity][0].y;
  float3 sums = shifted_sums(scratch.slot[parity][0], shift);
  for (int r = 1; r < static_cast<int>(cluster.num_blocks()); ++r)
    sums = Sum{}(sums, shifted_sums(scratch.slot[parity][r], shift));
  return moments_of(sums, shift);
}

// ---- Host side.

template <typename... KernelArgs>
cudaError_t prepare_clustered(void (*kernel)(KernelArgs...), int cluster, size_t smem_bytes) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_bytes));
  if (err == cudaSuccess && cluster > 8)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return err;
}

inline cudaLaunchConfig_t cluster_config(dim3 grid, int threads, size_t smem_bytes,
                                         cudaStream_t stream, cudaLaunchAttribute* attribute,
                                         int cluster) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Launches `kernel` on `grid` CTAs of `threads`, in clusters of `cluster` CTAs along x; a
// cluster of one is a plain launch (a kernel of ClusterOf<false>).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_clustered(void (*kernel)(KernelArgs...), dim3 grid, int threads, int cluster,
                             size_t smem_bytes, cudaStream_t stream, Args... args) {
  cudaError_t err = prepare_clustered(kernel, cluster, smem_bytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config =
      cluster_config(grid, threads, smem_bytes, stream, &attribute, cluster);
  if (!kBuiltForClusters && cluster != 1) return cudaErrorInvalidConfiguration;
  if (cluster == 1) config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

// Hopper's programmatic dependent launch, for a short kernel behind one of ours: launched with
// launch_early, its CTAs are scheduled as soon as every CTA of the kernel before it has called
// let_next_kernel_launch (or ended), and wait in wait_for_previous_kernel until that kernel's
// writes are visible, so the launch hides behind the other's last CTAs. Before sm_90 the launch
// is a plain one and both calls compile to nothing.
__device__ __forceinline__ void let_next_kernel_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// `kernel` must call wait_for_previous_kernel before it reads what the kernel before wrote.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_early(void (*kernel)(KernelArgs...), dim3 grid, int threads,
                         cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = kBuiltForClusters ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

// How many clusters of `cluster` CTAs of `threads` the GPU holds at once (0 when none fits).
template <typename... KernelArgs>
int max_active_clusters(void (*kernel)(KernelArgs...), int threads, int cluster,
                        size_t smem_bytes) {
  cudaError_t err = prepare_clustered(kernel, cluster, smem_bytes);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_config(dim3(cluster, 1, 1), threads, smem_bytes, nullptr, &attribute, cluster);
  int clusters = 0;
  if (err == cudaSuccess && kBuiltForClusters && cluster > 1) {
    err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
  } else if (err == cudaSuccess && cluster == 1) {
    int device = 0, sms = 0, per_sm = 0;
    err = cudaGetDevice(&device);
    if (err == cudaSuccess)
      err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess)
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
    clusters = sms * per_sm;
  }
  if (err != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

inline ffi::Error launch_error(const char* kernel, cudaError_t err) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(kernel) + ": " + cudaGetErrorString(err));
}

// Calls f(T{}) with the element type of an XLA dtype; false for types the kernels lack.
template <typename F>
bool dispatch_float(ffi::DataType dtype, F&& f) {
  switch (dtype) {
    case ffi::DataType::F32: f(float{}); return true;
    case ffi::DataType::BF16: f(__nv_bfloat16{}); return true;
    case ffi::DataType::F16: f(__half{}); return true;
    default: return false;
  }
}

template <typename T> constexpr ffi::DataType kDataType = ffi::DataType::F32;
template <> constexpr ffi::DataType kDataType<__nv_bfloat16> = ffi::DataType::BF16;
template <> constexpr ffi::DataType kDataType<__half> = ffi::DataType::F16;

// Calls f(T{}) when `dtype` is T's, f(float{}) when it is float32: the second operands of a
// kernel built for element type T (outputs and parameters are T or float32).
template <typename T, typename F>
bool dispatch_same_or_f32(ffi::DataType dtype, F&& f) {
  if (dtype == kDataType<T>) f(T{});
  else if (dtype == ffi::DataType::F32) f(float{});
  else return false;
  return true;
}

// Calls f(std::integral_constant<int, V>) for units-per-thread V in {1, 2, 4, 8} up to kMax:
// the instantiations a kernel is built for.
template <int kMax, int V = 1, typename F>
bool dispatch_units(int64_t units, F&& f) {
  if (units == V) {
    f(std::integral_constant<int, V>{});
    return true;
  }
  if constexpr (2 * V <= kMax) return dispatch_units<kMax, 2 * V>(units, f);
  return false;
}

// ---- Host side: checks of what an FFI handler is handed.
//
// XLA passes a handler whatever buffers and attributes its caller declared, and nothing on the
// way knows what the kernels need. So each handler checks every operand's size against the
// others and every attribute against what the kernels are built for, before anything launches:
// a mismatch comes back to Python as an error naming it, never as an out-of-bounds access.

inline std::string dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::PRED: return "bool";
    default: return "XLA dtype " + std::to_string(static_cast<int>(dtype));
  }
}

inline std::string shape_string(ffi::AnyBuffer::Dimensions dims) {
  std::string text = "(";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + (dims.size() == 1 ? ",)" : ")");
}

// The product of sizes, or -1 where it would overflow int64 (so that it equals no real count).
inline int64_t product(std::initializer_list<int64_t> sizes) {
  int64_t total = 1;
  for (const int64_t size : sizes)
    if (size < 0 || __builtin_mul_overflow(total, size, &total)) return -1;
  return total;
}

// One call's checks: the first that fails becomes the handler's InvalidArgument error. A
// message is formatted only when its check fails, so a well-formed call pays no formatting.
class Checks {
 public:
  explicit Checks(const char* op) : op_(op) {}

  template <typename Message> bool require(bool ok, Message&& message) {
    if (!ok && failure_.empty()) failure_ = message();
    return ok;
  }
  bool rank(const char* name, const ffi::AnyBuffer& buffer, size_t rank, const char* layout) {
    return require(buffer.dimensions().size() == rank, [&] {
      return std::string(name) + " must be " + layout + ", got shape " +
             shape_string(buffer.dimensions());
    });
  }
  bool same_shape(const char* name, const ffi::AnyBuffer& buffer, const char* like,
                  ffi::AnyBuffer::Dimensions dims) {
    const ffi::AnyBuffer::Dimensions mine = buffer.dimensions();
    bool same = mine.size() == dims.size();
    for (size_t i = 0; same && i < dims.size(); ++i) same = mine[i] == dims[i];
    return require(same, [&] {
      return std::string(name) + " has shape " + shape_string(mine) + ", which must match " +
             like + " " + shape_string(dims);
    });
  }
  // `formula` says where `expected` comes from, e.g. "G * R".
  bool count(const char* name, int64_t actual, int64_t expected, const char* formula = nullptr) {
    return require(actual == expected, [&] {
      return std::string(name) + " has " + std::to_string(actual) + " elements, not " +
             (formula ? std::string(formula) + " = " : "") + std::to_string(expected);
    });
  }
  bool dtype(const char* name, ffi::DataType actual, std::initializer_list<ffi::DataType> allowed,
             const char* rule) {
    bool found = false;
    for (const ffi::DataType d : allowed) found |= d == actual;
    return require(found, [&] {
      return std::string(name) + " is " + dtype_name(actual) + ", but must be " + rule;
    });
  }
  bool range(const char* name, int64_t value, int64_t lo, int64_t hi) {
    return require(lo <= value && value <= hi, [&] {
      return std::string(name) + "=" + std::to_string(value) + " is outside [" +
             std::to_string(lo) + ", " + std::to_string(hi) + "]";
    });
  }
  bool flag(const char* name, int64_t value) { return range(name, value, 0, 1); }
  bool at_least(const char* name, float value, float lo) {
    return require(std::isfinite(value) && value >= lo, [&] {
      return std::string(name) + "=" + std::to_string(value) + " must be finite and >= " +
             std::to_string(lo);
    });
  }

  bool ok() const { return failure_.empty(); }
  ffi::Error error() const {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, op_ + ": " + failure_);
  }

 private:
  std::string op_, failure_;
};

// How a launch holds its rows (cuda/__init__.py Tiling): `cluster` CTAs of `threads` threads,
// `units` units a thread, fed through `stages` shared-memory stages (0: registers); or, with
// `lanes`, a group of that many lanes of one warp per row. `clusters` clusters (for short rows,
// CTAs) along the grid's x.
struct Tiling {
  int64_t cluster, threads, units, stages, lanes, clusters;

  int64_t capacity() const {
    return lanes ? lanes * units * kUnit : cluster * threads * units * kUnit;
  }
  std::string describe() const {
    return "cluster=" + std::to_string(cluster) + " threads=" + std::to_string(threads) +
           " units=" + std::to_string(units) + " stages=" + std::to_string(stages) +
           " lanes=" + std::to_string(lanes) + " clusters=" + std::to_string(clusters);
  }
};

// A staged feed's stages: wait_copies names up to three pending copy groups, so four is the
// most that overlap (the bound also keeps a CTA's dynamic shared memory well within an int).
constexpr int64_t kMaxStages = 4;
constexpr int64_t kMaxUnitsPerThread = 8;
constexpr int64_t kMaxGridX = 2147483647;  // CUDA's limit on a grid's x dimension

inline bool check_row_length(Checks& checks, int64_t n) {
  return checks.require(n > 0 && n % kUnit == 0, [&] {
    return "rows of " + std::to_string(n) + " elements: the kernels take a positive multiple "
           "of " + std::to_string(kUnit);
  });
}

inline bool check_threads(Checks& checks, int64_t threads, int64_t max_threads) {
  return checks.require(threads > 0 && threads <= max_threads && threads % 32 == 0, [&] {
    return "threads=" + std::to_string(threads) + " must be a positive multiple of 32 up to " +
           std::to_string(max_threads);
  });
}

// The tiling's attributes within what any kernel is built for (each kernel's dispatch then
// refuses combinations it lacks), and rows of n elements, a positive multiple of 8, within its
// capacity. False on the first failure, so later checks may rely on earlier ones.
inline bool check_tiling(Checks& checks, int64_t n, const Tiling& t, int64_t max_threads) {
  return check_row_length(checks, n) &&
         checks.range("cluster", t.cluster, 1, kMaxCluster) &&
         check_threads(checks, t.threads, max_threads) &&
         checks.range("units", t.units, 1, kMaxUnitsPerThread) &&
         checks.range("stages", t.stages, 0, kMaxStages) &&
         checks.require(t.lanes == 0 || (t.lanes > 0 && t.lanes <= 32 &&
                                         (t.lanes & (t.lanes - 1)) == 0 && t.cluster == 1), [&] {
           return "lanes=" + std::to_string(t.lanes) + " must be 0 or a power of two up to 32 "
                  "with cluster=1 (got cluster=" + std::to_string(t.cluster) + ")";
         }) &&
         checks.range("clusters", t.clusters, 1, kMaxGridX / t.cluster) &&
         checks.require(t.capacity() >= n, [&] {
           return t.describe() + " holds " + std::to_string(t.capacity()) +
                  " elements of a row, fewer than its " + std::to_string(n);
         });
}

// A streaming tiling (units=0, Tiling.streaming on the Python side): no row is held, one CTA of
// `threads` walks each row of any length, `clusters` CTAs in all.
inline bool check_streaming_tiling(Checks& checks, int64_t n, const Tiling& t,
                                   int64_t max_threads) {
  return check_row_length(checks, n) &&
         checks.require(t.cluster == 1 && t.stages == 0 && t.lanes == 0, [&] {
           return t.describe() + ": a streaming tiling (units=0) takes one CTA a row, no "
                  "stages and no lanes";
         }) &&
         check_threads(checks, t.threads, max_threads) &&
         checks.range("clusters", t.clusters, 1, kMaxGridX);
}

}  // namespace jaxfuse
