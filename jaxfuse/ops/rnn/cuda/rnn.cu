// Persistent LSTM and GRU recurrences: one launch walks every time step of a layer, with each
// CTA's share of the recurrent weights held in shared memory for the whole walk.
//
// The input projection of all steps (x W_ih^T + biases) is one large matmul done by XLA before
// the launch (`xp`); what is left per step is the recurrent product h_{t-1} W_hh^T, the gates and
// the state update. CTA c of a direction owns `units` hidden units: the forward holds the gate
// rows of those units (the cell update is then local to the CTA), the backward the columns of
// W_hh for them (dh_{t-1} = dgates_t W_hh is then local). Per step every CTA reads the whole
// previous h (or dgates) of its direction from a small exchange buffer in global memory, which
// stays in L2, and one grid barrier per step publishes the next. The launch is cooperative, so
// all CTAs are resident and the barrier cannot wait on a CTA that never runs.
//
// The batch may be split into groups of rows, each an independent recurrence over its own CTAs
// with its own barrier: a CTA then stages fewer rows of h per step, which is what bounds a step
// at large batches (an SM takes in only so many bytes a microsecond from L2), and owns more
// units, whose weights it holds.
//
// The products run on tensor cores (mma.sync): M = 16 batch rows, N = 8 weight columns; the
// warps split N into `n_split` groups and K into the rest, whose partial sums meet in shared
// memory and are added in group order (the result does not depend on timing). float32 runs one
// TF32 product by default and three (the split-TF32 scheme) at precision HIGHEST, within the
// tests' float32 bounds.
//
// Ragged batches: at step s sequence b is running while s < length_b; the forward direction
// reads and writes position s, the reverse direction position length_b - 1 - s, so each
// sequence runs backwards from its own end. A step past the end keeps the state, writes a zero
// output at position s and a zero gradient.
#include "rows.cuh"

namespace jaxfuse {
namespace {

constexpr int kWarps = 16;  // against 8: benchmarks/results/2026-11-23-h100-tune-rnn-16-warps.json
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxNTiles = 8;   // a CTA's weight columns, in 8-wide mma tiles
constexpr int kPad = 4;         // words after each staged row: conflict-free fragment loads
constexpr int kMaxStages = 4;   // staging buffers in flight

enum class Op { kBf16, kF16, kTf32, kTf32x3 };
enum class Cell { kLstm, kGru };

template <Op kOp> struct Operand { using T = float; };
template <> struct Operand<Op::kBf16> { using T = __nv_bfloat16; };
template <> struct Operand<Op::kF16> { using T = __half; };

// Elements per 32-bit word; a k-tile is 8 words (16 half-width or 8 float elements).
template <Op kOp> constexpr int kPerWord = sizeof(float) / sizeof(typename Operand<kOp>::T);

__device__ __forceinline__ uint32_t to_tf32(uint32_t bits) {
  uint32_t out;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(out) : "f"(__uint_as_float(bits)));
  return out;
}

// c += a b over one k-tile: a 16 x k-tile of activations, b k-tile x 8 of weights.
template <Op kOp>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint2 b) {
  if constexpr (kOp == Op::kBf16 || kOp == Op::kF16) {
    if constexpr (kOp == Op::kBf16)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
    else
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
  } else {
    auto tf32 = [&](const uint32_t (&x)[4], uint2 y) {
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                   "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                   : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                   : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y.x), "r"(y.y));
    };
    if constexpr (kOp == Op::kTf32) {
      tf32(a, b);  // both operands were rounded to TF32 when written (exchanged, staged)
    } else {
      uint32_t big[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) big[i] = to_tf32(a[i]);
      // x = big + small with both TF32; the small-times-small term is below float32's ulp.
      uint32_t small[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        small[i] = to_tf32(__float_as_uint(__uint_as_float(a[i]) - __uint_as_float(big[i])));
      const uint2 b_big{to_tf32(b.x), to_tf32(b.y)};
      const uint2 b_small{
          to_tf32(__float_as_uint(__uint_as_float(b.x) - __uint_as_float(b_big.x))),
          to_tf32(__float_as_uint(__uint_as_float(b.y) - __uint_as_float(b_big.y)))};
      tf32(small, b_big);
      tf32(big, b_small);
      tf32(big, b_big);
    }
  }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

template <typename T> __device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <typename T> __device__ __forceinline__ T from_float(float v) { return T(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// A value written to the exchange, the products' A operand: in the operand type, and for one
// TF32 pass already rounded to TF32 (as the product would round it), so that the product
// reads it as is.
template <Op kOp> __device__ __forceinline__ typename Operand<kOp>::T exchanged(float v) {
  if constexpr (kOp == Op::kTf32) return __uint_as_float(to_tf32(__float_as_uint(v)));
  else return from_float<typename Operand<kOp>::T>(v);
}

// Every CTA of a (direction, batch group) arrives once per phase; `target` counts arrivals since
// the launch zeroed the counter. The CTA barrier orders all of the CTA's exchange writes before
// the releasing add, which publishes them (as cooperative groups' grid sync does); the acquiring
// load makes the other CTAs' visible, and the reads that follow go to L2 (cp.async.cg), never to
// a stale L1. The last thread arrives: it holds no item when the CTA has fewer than kThreads, so
// the release does not wait for an item's loads issued ahead for the next step.
__device__ __forceinline__ void grid_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == kThreads - 1) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

__device__ __forceinline__ void copy_async_16(void* shared, const void* global) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global)
               : "memory");
}
__device__ __forceinline__ void copy_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// Waits until at most `pending` (< kMaxStages) of this thread's copy groups are in flight.
__device__ __forceinline__ void copy_async_wait(int pending) {
  switch (pending) {
    case 0: copy_async_wait<0>(); break;
    case 1: copy_async_wait<1>(); break;
    case 2: copy_async_wait<2>(); break;
    default: copy_async_wait<kMaxStages - 1>(); break;
  }
}

// Sizes of one launch, shared by the forward and the backward (cuda/__init__.py Plan).
struct Shape {
  int batch, steps, hidden, directions;
  int first_direction;  // directions first_direction .. + grid / (groups * ctas) run here
  int ctas;             // CTAs per (direction, batch group)
  int units;            // hidden units per CTA (the last CTA may own fewer)
  int groups;           // batch groups per direction, each with its own barrier counter
  int group_rows;       // batch rows per group (the last may have fewer), a multiple of 16
  int inner_padded;     // K (hidden forward, gates * hidden backward) in whole k-tiles: the
                        // exchange's row length
  int columns;          // N: gates * units (forward) or units (backward)
  int n_split;          // warp groups along N; kWarps / n_split split K
  int batch_chunk;      // batch rows of a group staged at once, a multiple of 16
  int chunk_words;      // words of K staged at once, a multiple of 8
  int stages;           // staging buffers, filled ahead of use
  int save;             // forward: write the reserve for the backward
};

// The direction, batch rows and hidden units a CTA owns (the last CTA of a group may own fewer
// units, the last group fewer rows).
struct Share {
  int direction, group, first_unit, units, first_row, rows;
  __device__ explicit Share(const Shape& s)
      : direction(s.first_direction + blockIdx.x / (s.ctas * s.groups)),
        group(blockIdx.x / s.ctas % s.groups),
        first_unit((blockIdx.x % s.ctas) * s.units),
        units(min(s.units, s.hidden - first_unit)),
        first_row(group * s.group_rows),
        rows(min(s.group_rows, s.batch - first_row)) {}
};

// The CTA's share of the weights in mma-fragment order: for n-tile nt and k-tile kt, lane l
// holds uint2{b0, b1}. `weight(n, k)` is the weight at CTA column n and inner index k (zero
// outside). Stored once at the start of the launch.
template <Op kOp, typename Weight>
__device__ void stage_weights(uint2* fragments, int n_tiles, int k_tiles, Weight weight) {
  using T = typename Operand<kOp>::T;
  constexpr int kE = kPerWord<kOp>;
  for (int i = threadIdx.x; i < n_tiles * k_tiles * 32; i += blockDim.x) {
    const int lane = i % 32, kt = (i / 32) % k_tiles, nt = i / 32 / k_tiles;
    const int n = nt * 8 + lane / 4;
    uint32_t words[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k = (kt * 8 + lane % 4 + 4 * half) * kE;
      if constexpr (kE == 2) {
        const T lo = weight(n, k), hi = weight(n, k + 1);
        words[half] = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
                      (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
      } else {
        const uint32_t bits = __float_as_uint(weight(n, k));
        words[half] = kOp == Op::kTf32 ? to_tf32(bits) : bits;
      }
    }
    fragments[i] = make_uint2(words[0], words[1]);
  }
}

// Shared memory of a launch: weight fragments, the staging buffers, the K groups' partial sums.
struct Layout {
  uint2* fragments;
  uint32_t* staging;
  float* partial;
  int staged_stride, staged_size, partial_stride, n_tiles, k_groups, stages;

  __device__ Layout(const Shape& s, int k_tiles) {
    extern __shared__ uint4 shared[];
    n_tiles = (s.columns + 7) / 8;
    k_groups = kWarps / s.n_split;
    stages = s.stages;
    fragments = reinterpret_cast<uint2*>(shared);
    staged_stride = s.chunk_words + kPad;
    staged_size = s.batch_chunk * staged_stride;
    staging = reinterpret_cast<uint32_t*>(fragments + n_tiles * k_tiles * 32);
    partial = reinterpret_cast<float*>(staging + stages * staged_size);
    partial_stride = n_tiles * 8 + kPad;
  }
  __device__ uint32_t* staged(int chunk) const { return staging + chunk % stages * staged_size; }
};

__host__ size_t shared_bytes(int columns, int k_tiles, int batch_chunk, int chunk_words,
                             int stages, int n_split) {
  const size_t n_tiles = (columns + 7) / 8;
  return n_tiles * k_tiles * 32 * sizeof(uint2) +
         static_cast<size_t>(stages) * batch_chunk * (chunk_words + kPad) * sizeof(uint32_t) +
         static_cast<size_t>(kWarps / n_split) * batch_chunk * (n_tiles * 8 + kPad) *
             sizeof(float);
}

// partial[k][r][n] = sum over K group k's k-tiles of source[b0 + r] . weights[:, n], for the
// batch rows b0 .. b0 + rows of one chunk. `source` is the direction's exchange rows (B, K
// padded). K is staged in chunks through `stages` buffers, all filled ahead as far as they go.
template <Op kOp, typename T>
__device__ void recurrent_product(const Shape& s, const Layout& l, const T* source, int b0,
                                  int rows) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n_group = warp % s.n_split, k_group = warp / s.n_split;
  const int k_tiles = s.inner_padded / (8 * kPerWord<kOp>);
  const int m_tiles = (rows + 15) / 16;
  const int row_words = s.inner_padded / kPerWord<kOp>;
  const int chunks = (row_words + s.chunk_words - 1) / s.chunk_words;
  float* partial = l.partial + static_cast<size_t>(k_group) * s.batch_chunk * l.partial_stride;
  auto stage = [&](int chunk) {
    uint32_t* buffer = l.staged(chunk);
    const int first = chunk * s.chunk_words, words = min(s.chunk_words, row_words - first);
    const int vectors = words / 4;
    // A warp a row, its lanes along it: no division in the address arithmetic.
    for (int r = warp; r < m_tiles * 16; r += kWarps) {
      uint32_t* to = buffer + r * l.staged_stride;
      if (r < rows) {
        const uint32_t* from =
            reinterpret_cast<const uint32_t*>(source + static_cast<size_t>(b0 + r) *
                                                           s.inner_padded) + first;
        for (int v = lane; v < vectors; v += 32) copy_async_16(to + 4 * v, from + 4 * v);
      } else {
        for (int v = lane; v < vectors; v += 32)
          *reinterpret_cast<uint4*>(to + 4 * v) = make_uint4(0, 0, 0, 0);
      }
    }
    copy_async_commit();
  };
  for (int chunk = 0; chunk < min(l.stages, chunks); ++chunk) stage(chunk);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    copy_async_wait(min(chunks, chunk + l.stages) - chunk - 1);
    __syncthreads();
    const uint32_t* buffer = l.staged(chunk);
    const int first_tile = chunk * s.chunk_words / 8;
    const int tiles = min(s.chunk_words, row_words - chunk * s.chunk_words) / 8;
    for (int mt = 0; mt < m_tiles; ++mt) {
      // The warp's n-tiles are n_group, n_group + n_split, ...
      float acc[kMaxNTiles][4] = {};
      for (int kt = k_group; kt < tiles; kt += l.k_groups) {
        const uint32_t* p = buffer + (mt * 16 + g) * l.staged_stride + kt * 8 + t;
        const uint32_t a[4] = {p[0], p[8 * l.staged_stride], p[4], p[8 * l.staged_stride + 4]};
        const uint2* b = l.fragments + (first_tile + kt) * 32 + lane;
#pragma unroll
        for (int i = 0; i < kMaxNTiles; ++i) {
          const int nt = n_group + i * s.n_split;
          if (nt < l.n_tiles) mma<kOp>(acc[i], a, b[static_cast<size_t>(nt) * k_tiles * 32]);
        }
      }
      float* out = partial + (mt * 16 + g) * l.partial_stride + 2 * t;
#pragma unroll
      for (int i = 0; i < kMaxNTiles; ++i) {
        const int nt = n_group + i * s.n_split;
        if (nt >= l.n_tiles) continue;
        float2* top = reinterpret_cast<float2*>(out + nt * 8);
        float2* bottom = reinterpret_cast<float2*>(out + 8 * l.partial_stride + nt * 8);
        const float2 add_top = chunk ? *top : make_float2(0.f, 0.f);
        const float2 add_bottom = chunk ? *bottom : make_float2(0.f, 0.f);
        *top = make_float2(add_top.x + acc[i][0], add_top.y + acc[i][1]);
        *bottom = make_float2(add_bottom.x + acc[i][2], add_bottom.y + acc[i][3]);
      }
    }
    __syncthreads();  // the buffer is restaged next; the partials are read after the last chunk
    if (chunk + l.stages < chunks) stage(chunk + l.stages);
  }
}

template <int kGroups>
__device__ __forceinline__ float sum_groups(const float* p, int group_stride) {
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) total += p[k * group_stride];
  return total;
}

// The sum of the K groups' partials at batch row r (of the chunk) and column n, in group order.
// The count is a compile-time constant in each branch, so the loads issue back to back.
__device__ __forceinline__ float gathered(const Shape& s, const Layout& l, int r, int n) {
  const float* p = l.partial + r * l.partial_stride + n;
  const int group_stride = s.batch_chunk * l.partial_stride;
  switch (l.k_groups) {
    case 16: return sum_groups<16>(p, group_stride);
    case 8: return sum_groups<8>(p, group_stride);
    case 4: return sum_groups<4>(p, group_stride);
    case 2: return sum_groups<2>(p, group_stride);
    default: return sum_groups<1>(p, group_stride);
  }
}

struct ForwardArgs {
  const float* xp;        // (B, S, D, G * H)
  const void* w_hh;       // (D, G * H, H)
  const float* b_hn;      // (D, H), GRU
  const float* h0;        // (D, B, H)
  const float* c0;        // (D, B, H), LSTM
  const int32_t* lengths; // (B,)
  void* y;                // (B, S, D, H)
  float* h_n;             // (D, B, H): the running state
  float* c_n;             // (D, B, H): the running cell state, LSTM
  float* gates;           // (B, S, D, 4 * H) reserve: LSTM i f g o, GRU r z n and W_hn h + b_hn
  float* states;          // (B, S, D, H) reserve: LSTM c, GRU h
  void* exchange;         // (2, D, B, H padded): h_{t-1} in the operand type, zero padded
  unsigned* sync;         // (D,) barrier counters, zeroed before the launch
};

template <Cell kCell, Op kOp>
__global__ void __launch_bounds__(kThreads, 1) rnn_forward(Shape s, ForwardArgs a) {
  using T = typename Operand<kOp>::T;
  constexpr int G = kCell == Cell::kLstm ? 4 : 3;
  const Share mine(s);
  const int d = mine.direction, j0 = mine.first_unit, units = mine.units;
  const int H = s.hidden, B = s.batch, D = s.directions;
  const int first_row = mine.first_row, end_row = first_row + mine.rows;
  const bool reverse = d == 1;
  const int k_tiles = s.inner_padded / (8 * kPerWord<kOp>);
  const Layout l(s, k_tiles);
  const T* w = static_cast<const T*>(a.w_hh) + static_cast<size_t>(d) * G * H * H;
  // Column n = gate * units + u is row gate * H + j0 + u of W_hh.
  stage_weights<kOp>(l.fragments, l.n_tiles, k_tiles, [&](int n, int k) {
    const int gate = n / s.units, u = n % s.units;
    return n < G * s.units && u < units && k < H
               ? w[(static_cast<size_t>(gate) * H + j0 + u) * H + k]
               : T(0.f);
  });
  T* exchange = static_cast<T*>(a.exchange);
  auto exchange_row = [&](int buffer, int b) {
    return exchange + ((static_cast<size_t>(buffer) * D + d) * B + b) * s.inner_padded;
  };
  // The running state starts as h_0 (and c_0); step 0 reads h_0 from exchange buffer 1. When
  // the group's rows are one chunk a thread keeps the same item every step, and its state stays
  // in registers (h_n and c_n are written once, at the end); else it lives in h_n and c_n.
  const bool one_chunk = s.batch_chunk >= mine.rows;
  float h_state = 0.f, c_state = 0.f;
  for (int i = threadIdx.x; i < mine.rows * units; i += blockDim.x) {
    const int b = first_row + i / units, j = j0 + i % units;
    const size_t at = (static_cast<size_t>(d) * B + b) * H + j;
    h_state = a.h0[at];
    if (kCell == Cell::kLstm) c_state = a.c0[at];
    if (!one_chunk) {
      a.h_n[at] = h_state;
      if (kCell == Cell::kLstm) a.c_n[at] = c_state;
    }
    exchange_row(1, b)[j] = exchanged<kOp>(h_state);
  }
  unsigned* counter = a.sync + d * s.groups + mine.group;
  unsigned phase = 1;
  grid_barrier(counter, phase++ * s.ctas);

  const size_t row_xp = static_cast<size_t>(D) * G * H;
  // The sequence length of the thread's item when it keeps one, read once.
  const int item_length = one_chunk && threadIdx.x < mine.rows * units
                              ? a.lengths[first_row + threadIdx.x / units]
                              : 0;
  auto length_of = [&](int b) { return one_chunk ? item_length : a.lengths[b]; };
  // The input projections of the thread's (batch row, unit) item, loaded ahead: for the next
  // step while this one waits at the barrier when the group's rows are one chunk.
  float xp[G];
  auto load_xp = [&](int step, int b0, int rows) {
    const int i = threadIdx.x;
    if (i >= rows * units) return;
    const int b = b0 + i / units, j = j0 + i % units;
    const int length = length_of(b);
    if (step >= length) return;
    const int position = reverse ? length - 1 - step : step;
    const float* p = a.xp + (static_cast<size_t>(b) * s.steps + position) * row_xp +
                     static_cast<size_t>(d) * G * H + j;
#pragma unroll
    for (int gate = 0; gate < G; ++gate) xp[gate] = p[gate * H];
  };
  if (one_chunk) load_xp(0, first_row, mine.rows);

  for (int step = 0; step < s.steps; ++step) {
    const int read = (step + 1) & 1, write = step & 1;
    for (int b0 = first_row; b0 < end_row; b0 += s.batch_chunk) {
      const int rows = min(s.batch_chunk, end_row - b0);
      if (!one_chunk) load_xp(step, b0, rows);
      recurrent_product<kOp>(s, l, exchange_row(read, 0), b0, rows);
      // A thread updates one (batch row, unit) item of the chunk.
      const int i = threadIdx.x;
      if (i < rows * units) [&] {
        const int r = i / units, u = i % units, b = b0 + r, j = j0 + u;
        const int length = length_of(b);
        T* y = static_cast<T*>(a.y);
        const size_t state_at = (static_cast<size_t>(d) * B + b) * H + j;
        const float h_prev = one_chunk ? h_state : a.h_n[state_at];
        if (step >= length) {  // past the end: zero output, state kept
          y[((static_cast<size_t>(b) * s.steps + step) * D + d) * H + j] = T(0.f);
          exchange_row(write, b)[j] = exchanged<kOp>(h_prev);
          return;
        }
        const int position = reverse ? length - 1 - step : step;
        const size_t at = (static_cast<size_t>(b) * s.steps + position) * D + d;
        float h;
        float saved[4];
        if constexpr (kCell == Cell::kLstm) {
          const float in = sigmoid(xp[0] + gathered(s, l, r, 0 * s.units + u));
          const float forget = sigmoid(xp[1] + gathered(s, l, r, 1 * s.units + u));
          const float cand = tanhf(xp[2] + gathered(s, l, r, 2 * s.units + u));
          const float out = sigmoid(xp[3] + gathered(s, l, r, 3 * s.units + u));
          const float c = forget * (one_chunk ? c_state : a.c_n[state_at]) + in * cand;
          h = out * tanhf(c);
          if (one_chunk) c_state = c;
          else a.c_n[state_at] = c;
          saved[0] = in, saved[1] = forget, saved[2] = cand, saved[3] = out;
          if (s.save) a.states[at * H + j] = c;
        } else {
          const float hidden_n = gathered(s, l, r, 2 * s.units + u) + a.b_hn[d * H + j];
          const float reset = sigmoid(xp[0] + gathered(s, l, r, 0 * s.units + u));
          const float update = sigmoid(xp[1] + gathered(s, l, r, 1 * s.units + u));
          const float cand = tanhf(xp[2] + reset * hidden_n);
          h = (1.f - update) * cand + update * h_prev;
          saved[0] = reset, saved[1] = update, saved[2] = cand, saved[3] = hidden_n;
          if (s.save) a.states[at * H + j] = h;
        }
        if (s.save) {
#pragma unroll
          for (int gate = 0; gate < 4; ++gate) a.gates[at * 4 * H + gate * H + j] = saved[gate];
        }
        if (one_chunk) h_state = h;
        else a.h_n[state_at] = h;
        y[at * H + j] = from_float<T>(h);
        exchange_row(write, b)[j] = exchanged<kOp>(h);
      }();
      if (one_chunk && step + 1 < s.steps) load_xp(step + 1, first_row, mine.rows);
      __syncthreads();  // the staging and partials are reused by the next chunk
    }
    grid_barrier(counter, phase++ * s.ctas);
  }
  if (one_chunk && threadIdx.x < mine.rows * units) {
    const size_t at = (static_cast<size_t>(d) * B + first_row + threadIdx.x / units) * H + j0 +
                      threadIdx.x % units;
    a.h_n[at] = h_state;
    if (kCell == Cell::kLstm) a.c_n[at] = c_state;
  }
}

struct BackwardArgs {
  const void* dy;         // (B, S, D, H), the output's type
  const float* dh_n;      // (D, B, H)
  const float* dc_n;      // (D, B, H), LSTM
  const float* gates;     // (B, S, D, 4 * H) forward reserve
  const float* states;    // (B, S, D, H) forward reserve
  const float* h0;        // (D, B, H), GRU
  const float* c0;        // (D, B, H), LSTM
  const void* w_hh;       // (D, G * H, H)
  const int32_t* lengths; // (B,)
  float* dxp;             // (B, S, D, G * H): gradient of the input projection
  float* dhn;             // (B, S, D, H): GRU, gradient of W_hn h + b_hn
  float* dh0;             // (D, B, H): the running gradient of h, then of h_0
  float* dc0;             // (D, B, H): the running gradient of c, then of c_0; LSTM
  void* exchange;         // (2, D, B, G * H padded): dgates_{t+1} through W_hh, zero padded
  unsigned* sync;         // (D,)
};

template <typename DyT, Cell kCell, Op kOp>
__global__ void __launch_bounds__(kThreads, 1) rnn_backward(Shape s, BackwardArgs a) {
  using T = typename Operand<kOp>::T;
  constexpr int G = kCell == Cell::kLstm ? 4 : 3;
  const Share mine(s);
  const int d = mine.direction, j0 = mine.first_unit, units = mine.units;
  const int H = s.hidden, B = s.batch, D = s.directions, GH = G * H;
  const int first_row = mine.first_row, end_row = first_row + mine.rows;
  const bool reverse = d == 1;
  const int k_tiles = s.inner_padded / (8 * kPerWord<kOp>);
  const Layout l(s, k_tiles);
  const T* w = static_cast<const T*>(a.w_hh) + static_cast<size_t>(d) * GH * H;
  // Column n = u is column j0 + u of W_hh, over its G * H rows.
  stage_weights<kOp>(l.fragments, l.n_tiles, k_tiles, [&](int n, int k) {
    return n < units && k < GH ? w[static_cast<size_t>(k) * H + j0 + n] : T(0.f);
  });
  T* exchange = static_cast<T*>(a.exchange);
  auto exchange_row = [&](int buffer, int b) {
    return exchange + ((static_cast<size_t>(buffer) * D + d) * B + b) * s.inner_padded;
  };
  // The carried gradients of h and c start as dh_n and dc_n: in registers when the group's rows
  // are one chunk (as the forward's state), else in dh0 and dc0.
  const bool one_chunk = s.batch_chunk >= mine.rows;
  float dh_carry = 0.f, dc_carry = 0.f;
  for (int i = threadIdx.x; i < mine.rows * units; i += blockDim.x) {
    const size_t at = (static_cast<size_t>(d) * B + first_row + i / units) * H + j0 + i % units;
    dh_carry = a.dh_n[at];
    if (kCell == Cell::kLstm) dc_carry = a.dc_n[at];
    if (!one_chunk) {
      a.dh0[at] = dh_carry;
      if (kCell == Cell::kLstm) a.dc0[at] = dc_carry;
    }
  }
  __syncthreads();
  unsigned* counter = a.sync + d * s.groups + mine.group;
  unsigned phase = 1;
  const DyT* dy = static_cast<const DyT*>(a.dy);
  const int item_length = one_chunk && threadIdx.x < mine.rows * units
                              ? a.lengths[first_row + threadIdx.x / units]
                              : 0;
  auto length_of = [&](int b) { return one_chunk ? item_length : a.lengths[b]; };
  // What the thread's item reads of the forward's reserve and of dy at a step, loaded ahead:
  // for the step before while this one waits at the barrier when the rows are one chunk.
  struct {
    float gates[4], state, previous, dy;
  } saved;
  auto load_saved = [&](int step, int b0, int rows) {
    const int i = threadIdx.x;
    if (step < 0 || i >= rows * units) return;
    const int b = b0 + i / units, j = j0 + i % units;
    const int length = length_of(b);
    if (step >= length) return;
    const int position = reverse ? length - 1 - step : step;
    const int previous = reverse ? position + 1 : position - 1;
    const size_t at = (static_cast<size_t>(b) * s.steps + position) * D + d;
#pragma unroll
    for (int gate = 0; gate < 4; ++gate) saved.gates[gate] = a.gates[at * 4 * H + gate * H + j];
    if (kCell == Cell::kLstm) saved.state = a.states[at * H + j];
    const float* initial = kCell == Cell::kLstm ? a.c0 : a.h0;
    saved.previous =
        step == 0 ? initial[(static_cast<size_t>(d) * B + b) * H + j]
                  : a.states[((static_cast<size_t>(b) * s.steps + previous) * D + d) * H + j];
    saved.dy = to_float(dy[at * H + j]);
  };
  if (one_chunk) load_saved(s.steps - 1, first_row, mine.rows);

  // Step -1 only finishes dh_0 with the recurrent gradient of step 0.
  for (int step = s.steps - 1; step >= -1; --step) {
    const int read = (step + 1) & 1, write = step & 1;
    for (int b0 = first_row; b0 < end_row; b0 += s.batch_chunk) {
      const int rows = min(s.batch_chunk, end_row - b0);
      if (!one_chunk) load_saved(step, b0, rows);
      recurrent_product<kOp>(s, l, exchange_row(read, 0), b0, rows);
      // A thread updates one (batch row, unit) item of the chunk.
      const int i = threadIdx.x;
      if (i < rows * units) [&] {
        const int r = i / units, u = i % units, b = b0 + r, j = j0 + u;
        const size_t state_at = (static_cast<size_t>(d) * B + b) * H + j;
        const float dc_carried = one_chunk ? dc_carry : a.dc0[state_at];
        auto carry = [&](float dh, float dc) {
          if (one_chunk) {
            dh_carry = dh, dc_carry = dc;
          } else {
            a.dh0[state_at] = dh;
            if (kCell == Cell::kLstm) a.dc0[state_at] = dc;
          }
        };
        // The gradient of the state h after this step: carried, plus through W_hh from the
        // step after (zero when that step did not run).
        const float dh_state = (one_chunk ? dh_carry : a.dh0[state_at]) + gathered(s, l, r, u);
        if (step < 0) {
          a.dh0[state_at] = dh_state;
          if (kCell == Cell::kLstm) a.dc0[state_at] = dc_carried;
          return;
        }
        const int length = length_of(b);
        T* next = exchange_row(write, b);
        if (step >= length) {  // held: the gradient passes through, nothing flows into W
          carry(dh_state, dc_carried);
          const size_t at = (static_cast<size_t>(b) * s.steps + step) * D + d;
          for (int gate = 0; gate < G; ++gate) {
            a.dxp[at * GH + gate * H + j] = 0.f;
            next[gate * H + j] = T(0.f);
          }
          if (kCell == Cell::kGru) a.dhn[at * H + j] = 0.f;
          return;
        }
        const int position = reverse ? length - 1 - step : step;
        const size_t at = (static_cast<size_t>(b) * s.steps + position) * D + d;
        const float dh = dh_state + saved.dy;
        float input_grads[G], hidden_grads[G];
        if constexpr (kCell == Cell::kLstm) {
          const float in = saved.gates[0], forget = saved.gates[1], cand = saved.gates[2];
          const float out = saved.gates[3], c = saved.state, c_prev = saved.previous;
          const float tanh_c = tanhf(c);
          const float dc = dc_carried + dh * out * (1.f - tanh_c * tanh_c);
          input_grads[0] = dc * cand * in * (1.f - in);
          input_grads[1] = dc * c_prev * forget * (1.f - forget);
          input_grads[2] = dc * in * (1.f - cand * cand);
          input_grads[3] = dh * tanh_c * out * (1.f - out);
          carry(0.f, dc * forget);
#pragma unroll
          for (int gate = 0; gate < G; ++gate) hidden_grads[gate] = input_grads[gate];
        } else {
          const float reset = saved.gates[0], update = saved.gates[1], cand = saved.gates[2];
          const float hidden_n = saved.gates[3], h_prev = saved.previous;
          const float dcand = dh * (1.f - update) * (1.f - cand * cand);
          input_grads[0] = dcand * hidden_n * reset * (1.f - reset);
          input_grads[1] = dh * (h_prev - cand) * update * (1.f - update);
          input_grads[2] = dcand;
          hidden_grads[0] = input_grads[0];
          hidden_grads[1] = input_grads[1];
          hidden_grads[2] = dcand * reset;
          a.dhn[at * H + j] = hidden_grads[2];
          carry(dh * update, 0.f);
        }
#pragma unroll
        for (int gate = 0; gate < G; ++gate) {
          a.dxp[at * GH + gate * H + j] = input_grads[gate];
          next[gate * H + j] = exchanged<kOp>(hidden_grads[gate]);
        }
      }();
      if (one_chunk) load_saved(step - 1, first_row, mine.rows);
      __syncthreads();
    }
    if (step >= 0) grid_barrier(counter, phase++ * s.ctas);
  }
}

// ---- Host side.

using ffi::DataType;
using F32Buffer = ffi::Buffer<DataType::F32>;

Op op_of(DataType dtype, int64_t exact) {
  switch (dtype) {
    case DataType::BF16: return Op::kBf16;
    case DataType::F16: return Op::kF16;
    default: return exact ? Op::kTf32x3 : Op::kTf32;
  }
}

// Calls f(cell, op) as integral constants for the instantiation of (gates, dtype, exact);
// check_shape has already refused gates other than 3 and 4.
template <typename F>
void dispatch(int64_t gates, DataType dtype, int64_t exact, F&& f) {
  const Op op = op_of(dtype, exact);
  auto with_op = [&](auto cell) {
    switch (op) {
      case Op::kBf16: f(cell, std::integral_constant<Op, Op::kBf16>{}); break;
      case Op::kF16: f(cell, std::integral_constant<Op, Op::kF16>{}); break;
      case Op::kTf32: f(cell, std::integral_constant<Op, Op::kTf32>{}); break;
      case Op::kTf32x3: f(cell, std::integral_constant<Op, Op::kTf32x3>{}); break;
    }
  };
  if (gates == 4) with_op(std::integral_constant<Cell, Cell::kLstm>{});
  else with_op(std::integral_constant<Cell, Cell::kGru>{});
}

template <typename Kernel>
cudaError_t launch_cooperative(Kernel kernel, int grid, size_t bytes, cudaStream_t stream,
                               const Shape& s, void* args) {
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  Shape shape = s;
  void* params[] = {&shape, args};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(grid),
                                     dim3(kThreads), params, bytes, stream);
}

struct Attributes {
  int64_t gates, ctas, units, groups, group_rows, n_split, batch_chunk, chunk_words, stages,
      concurrent, exact;
};

// Checks shared by both directions of the pass; fills the shape of one launch.
bool check_shape(Checks& checks, const Attributes& at, int64_t batch, int64_t steps,
                 int64_t hidden, int64_t directions, int64_t inner, int64_t per_word,
                 bool forward, Shape* s) {
  checks.require(at.gates == 3 || at.gates == 4,
                 [&] { return "gates=" + std::to_string(at.gates) + " is neither 3 nor 4"; });
  checks.range("directions", directions, 1, 2);
  checks.range("units", at.units, 1, 64);
  checks.require(at.ctas * at.units >= hidden && (at.ctas - 1) * at.units < hidden, [&] {
    return "ctas=" + std::to_string(at.ctas) + " of units=" + std::to_string(at.units) +
           " do not cover hidden=" + std::to_string(hidden) + " exactly";
  });
  const int64_t columns = forward ? at.gates * at.units : at.units;
  checks.require(columns <= 8 * kMaxNTiles, [&] {
    return "a CTA holds at most " + std::to_string(8 * kMaxNTiles) + " weight columns, not " +
           std::to_string(columns);
  });
  checks.require(at.group_rows > 0 && at.group_rows % 16 == 0 &&
                     at.groups * at.group_rows >= batch && (at.groups - 1) * at.group_rows < batch,
                 [&] {
    return "groups=" + std::to_string(at.groups) + " of group_rows=" +
           std::to_string(at.group_rows) + " (a multiple of 16) do not cover batch=" +
           std::to_string(batch) + " exactly";
  });
  checks.require(at.n_split > 0 && kWarps % at.n_split == 0, [&] {
    return "n_split=" + std::to_string(at.n_split) + " does not divide " +
           std::to_string(kWarps) + " warps";
  });
  checks.range("stages", at.stages, 1, kMaxStages);
  checks.require(at.batch_chunk > 0 && at.batch_chunk % 16 == 0 &&
                     at.batch_chunk <= at.group_rows && at.batch_chunk * at.units <= kThreads,
                 [&] {
    return "batch_chunk=" + std::to_string(at.batch_chunk) + " must be a positive multiple of "
           "16, at most group_rows, with at most " + std::to_string(kThreads) +
           " (row, unit) items";
  });
  checks.require(at.chunk_words > 0 && at.chunk_words % 8 == 0, [&] {
    return "chunk_words=" + std::to_string(at.chunk_words) + " must be a positive multiple of 8";
  });
  checks.flag("concurrent", at.concurrent);
  checks.flag("exact", at.exact);
  checks.range("batch", batch, 1, INT32_MAX / 1024);
  checks.range("steps", steps, 1, INT32_MAX);
  checks.range("hidden", hidden, 1, 1 << 16);
  if (!checks.ok()) return false;
  const int64_t tile = 8 * per_word;
  s->batch = static_cast<int>(batch);
  s->steps = static_cast<int>(steps);
  s->hidden = static_cast<int>(hidden);
  s->directions = static_cast<int>(directions);
  s->first_direction = 0;
  s->ctas = static_cast<int>(at.ctas);
  s->units = static_cast<int>(at.units);
  s->groups = static_cast<int>(at.groups);
  s->group_rows = static_cast<int>(at.group_rows);
  s->n_split = static_cast<int>(at.n_split);
  s->stages = static_cast<int>(at.stages);
  s->inner_padded = static_cast<int>((inner + tile - 1) / tile * tile);
  s->columns = static_cast<int>(columns);
  s->batch_chunk = static_cast<int>(at.batch_chunk);
  s->chunk_words = static_cast<int>(at.chunk_words);
  s->save = 0;
  return true;
}

int64_t per_word(DataType dtype) { return dtype == DataType::F32 ? 1 : 2; }

// Launches directions together, or one after the other when they do not fit at once.
template <typename Launch>
cudaError_t each_launch(const Shape& s, bool concurrent, Launch&& launch) {
  const int per_direction = s.ctas * s.groups;
  if (concurrent) return launch(s, per_direction * s.directions);
  for (int d = 0; d < s.directions; ++d) {
    Shape one = s;
    one.first_direction = d;
    const cudaError_t err = launch(one, per_direction);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The exchange buffers (2, D, B, padded K) of the operand type and the barrier counters, one
// a (direction, batch group).
void check_scratch(Checks& checks, const ffi::AnyBuffer& exchange,
                   const ffi::Buffer<DataType::U32>& sync, DataType type, const Shape& s) {
  checks.require(exchange.element_type() == type, [&] {
    return "exchange is " + dtype_name(exchange.element_type()) + ", not " + dtype_name(type);
  });
  checks.count("exchange", exchange.element_count(),
               product({2, s.directions, s.batch, s.inner_padded}), "2 * D * B * padded K");
  checks.count("sync", sync.element_count(), product({s.directions, s.groups}), "D * groups");
}

// Zero padding the products read and a zero step before the first (the backward's), and
// barrier counters from zero.
cudaError_t zero_scratch(ffi::AnyBuffer& exchange, ffi::Buffer<DataType::U32>& sync,
                         cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(exchange.untyped_data(), 0, exchange.size_bytes(), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(sync.typed_data(), 0, sync.size_bytes(), stream);
  return err;
}

size_t launch_bytes(const Shape& s, int64_t per) {
  return shared_bytes(s.columns, s.inner_padded / (8 * static_cast<int>(per)), s.batch_chunk,
                      s.chunk_words, s.stages, s.n_split);
}

ffi::Error RnnForwardImpl(cudaStream_t stream, F32Buffer xp, ffi::AnyBuffer w_hh, F32Buffer b_hn,
                          F32Buffer h0, F32Buffer c0, ffi::Buffer<DataType::S32> lengths,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<F32Buffer> h_n,
                          ffi::Result<F32Buffer> c_n, ffi::Result<F32Buffer> gates,
                          ffi::Result<F32Buffer> states, ffi::Result<ffi::AnyBuffer> exchange,
                          ffi::Result<ffi::Buffer<DataType::U32>> sync, int64_t gate_count,
                          int64_t ctas, int64_t units, int64_t groups, int64_t group_rows,
                          int64_t n_split, int64_t batch_chunk, int64_t chunk_words,
                          int64_t stages, int64_t concurrent, int64_t exact, int64_t save) {
  Checks checks("rnn_forward");
  const auto dims = xp.dimensions();
  if (!checks.require(dims.size() == 4, [&] {
        return "xp must be (B, S, D, G * H), got shape " + shape_string(dims);
      }))
    return checks.error();
  const int64_t B = dims[0], S = dims[1], D = dims[2];
  const Attributes at{gate_count, ctas,        units,  groups,     group_rows, n_split,
                      batch_chunk, chunk_words, stages, concurrent, exact};
  const int64_t H = dims[3] / std::max<int64_t>(at.gates, 1);  // gates are checked below
  const DataType type = w_hh.element_type();
  checks.dtype("w_hh", type, {DataType::F32, DataType::BF16, DataType::F16},
               "float32, bfloat16 or float16");
  Shape s{};
  if (!check_shape(checks, at, B, S, H, D, H, per_word(type), true, &s)) return checks.error();
  checks.count("xp", xp.element_count(), product({B, S, D, at.gates * H}), "B * S * D * G * H");
  checks.count("w_hh", w_hh.element_count(), product({D, at.gates * H, H}), "D * G * H * H");
  checks.count("b_hn", b_hn.element_count(), product({D, H}), "D * H");
  checks.count("h0", h0.element_count(), product({D, B, H}), "D * B * H");
  checks.count("c0", c0.element_count(), product({D, B, H}), "D * B * H");
  checks.count("lengths", lengths.element_count(), B, "B");
  checks.count("y", y->element_count(), product({B, S, D, H}), "B * S * D * H");
  checks.require(y->element_type() == type, [&] {
    return "y is " + dtype_name(y->element_type()) + ", not w_hh's " + dtype_name(type);
  });
  checks.count("h_n", h_n->element_count(), product({D, B, H}), "D * B * H");
  checks.count("c_n", c_n->element_count(), product({D, B, H}), "D * B * H");
  checks.flag("save", save);
  if (save) {
    checks.count("gates", gates->element_count(), product({B, S, D, 4 * H}), "B * S * D * 4H");
    checks.count("states", states->element_count(), product({B, S, D, H}), "B * S * D * H");
  }
  check_scratch(checks, *exchange, *sync, type, s);
  if (!checks.ok()) return checks.error();
  s.save = static_cast<int>(save);
  const ForwardArgs args{xp.typed_data(), w_hh.untyped_data(), b_hn.typed_data(),
                         h0.typed_data(), c0.typed_data(), lengths.typed_data(),
                         y->untyped_data(), h_n->typed_data(), c_n->typed_data(),
                         gates->typed_data(), states->typed_data(), exchange->untyped_data(),
                         sync->typed_data()};
  cudaError_t err = zero_scratch(*exchange, *sync, stream);
  if (err != cudaSuccess) return launch_error("rnn_forward", err);
  const size_t bytes = launch_bytes(s, per_word(type));
  dispatch(at.gates, type, exact, [&](auto cell, auto op) {
    auto kernel = rnn_forward<decltype(cell)::value, decltype(op)::value>;
    err = each_launch(s, concurrent, [&](const Shape& one, int grid) {
      ForwardArgs copy = args;
      return launch_cooperative(kernel, grid, bytes, stream, one, &copy);
    });
  });
  return launch_error("rnn_forward", err);
}

ffi::Error RnnBackwardImpl(cudaStream_t stream, ffi::AnyBuffer dy, F32Buffer dh_n, F32Buffer dc_n,
                           F32Buffer gates, F32Buffer states, F32Buffer h0, F32Buffer c0,
                           ffi::AnyBuffer w_hh, ffi::Buffer<DataType::S32> lengths,
                           ffi::Result<F32Buffer> dxp, ffi::Result<F32Buffer> dhn,
                           ffi::Result<F32Buffer> dh0, ffi::Result<F32Buffer> dc0,
                           ffi::Result<ffi::AnyBuffer> exchange,
                           ffi::Result<ffi::Buffer<DataType::U32>> sync, int64_t gate_count,
                           int64_t ctas, int64_t units, int64_t groups, int64_t group_rows,
                           int64_t n_split, int64_t batch_chunk, int64_t chunk_words,
                           int64_t stages, int64_t concurrent, int64_t exact) {
  Checks checks("rnn_backward");
  const auto dims = dy.dimensions();
  if (!checks.rank("dy", dy, 4, "(B, S, D, H)")) return checks.error();
  const int64_t B = dims[0], S = dims[1], D = dims[2], H = dims[3];
  const Attributes at{gate_count, ctas,        units,  groups,     group_rows, n_split,
                      batch_chunk, chunk_words, stages, concurrent, exact};
  const DataType type = w_hh.element_type();
  checks.dtype("w_hh", type, {DataType::F32, DataType::BF16, DataType::F16},
               "float32, bfloat16 or float16");
  checks.dtype("dy", dy.element_type(), {DataType::F32, type}, "float32 or w_hh's type");
  Shape s{};
  if (!check_shape(checks, at, B, S, H, D, at.gates * H, per_word(type), false, &s))
    return checks.error();
  const int64_t GH = at.gates * H;
  checks.count("dh_n", dh_n.element_count(), product({D, B, H}), "D * B * H");
  checks.count("dc_n", dc_n.element_count(), product({D, B, H}), "D * B * H");
  checks.count("gates", gates.element_count(), product({B, S, D, 4 * H}), "B * S * D * 4H");
  checks.count("states", states.element_count(), product({B, S, D, H}), "B * S * D * H");
  checks.count("h0", h0.element_count(), product({D, B, H}), "D * B * H");
  checks.count("c0", c0.element_count(), product({D, B, H}), "D * B * H");
  checks.count("w_hh", w_hh.element_count(), product({D, GH, H}), "D * G * H * H");
  checks.count("lengths", lengths.element_count(), B, "B");
  checks.count("dxp", dxp->element_count(), product({B, S, D, GH}), "B * S * D * G * H");
  if (at.gates == 3)  // the LSTM has no such gradient and is handed a placeholder
    checks.count("dhn", dhn->element_count(), product({B, S, D, H}), "B * S * D * H");
  checks.count("dh0", dh0->element_count(), product({D, B, H}), "D * B * H");
  checks.count("dc0", dc0->element_count(), product({D, B, H}), "D * B * H");
  check_scratch(checks, *exchange, *sync, type, s);
  if (!checks.ok()) return checks.error();
  const BackwardArgs args{dy.untyped_data(), dh_n.typed_data(), dc_n.typed_data(),
                          gates.typed_data(), states.typed_data(), h0.typed_data(),
                          c0.typed_data(), w_hh.untyped_data(), lengths.typed_data(),
                          dxp->typed_data(), dhn->typed_data(), dh0->typed_data(),
                          dc0->typed_data(), exchange->untyped_data(), sync->typed_data()};
  cudaError_t err = zero_scratch(*exchange, *sync, stream);
  if (err != cudaSuccess) return launch_error("rnn_backward", err);
  const size_t bytes = launch_bytes(s, per_word(type));
  const bool dy_f32 = dy.element_type() == DataType::F32;
  dispatch(at.gates, type, exact, [&](auto cell, auto op) {
    using T = typename Operand<decltype(op)::value>::T;
    auto run = [&](auto kernel) {
      err = each_launch(s, concurrent, [&](const Shape& one, int grid) {
        BackwardArgs copy = args;
        return launch_cooperative(kernel, grid, bytes, stream, one, &copy);
      });
    };
    if (dy_f32) run(rnn_backward<float, decltype(cell)::value, decltype(op)::value>);
    else run(rnn_backward<T, decltype(cell)::value, decltype(op)::value>);
  });
  return launch_error("rnn_backward", err);
}

}  // namespace
}  // namespace jaxfuse

namespace jaxfuse {
namespace {

// The launch plan's attributes (cuda/__init__.py Plan), last in both handlers' bindings.
template <typename Binding>
auto with_plan(Binding binding) {
  return std::move(binding).template Attr<int64_t>("gate_count")
      .template Attr<int64_t>("ctas")
      .template Attr<int64_t>("units")
      .template Attr<int64_t>("groups")
      .template Attr<int64_t>("group_rows")
      .template Attr<int64_t>("n_split")
      .template Attr<int64_t>("batch_chunk")
      .template Attr<int64_t>("chunk_words")
      .template Attr<int64_t>("stages")
      .template Attr<int64_t>("concurrent")
      .template Attr<int64_t>("exact");
}

}  // namespace
}  // namespace jaxfuse

// These handlers launch only on XLA's stream and allocate nothing, so XLA may capture them
// into the CUDA graphs it runs a jitted program's kernels from.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfuseRnnForward, jaxfuse::RnnForwardImpl,
    jaxfuse::with_plan(xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                           .Arg<jaxfuse::F32Buffer>()            // xp
                           .Arg<xla::ffi::AnyBuffer>()           // w_hh
                           .Arg<jaxfuse::F32Buffer>()            // b_hn
                           .Arg<jaxfuse::F32Buffer>()            // h0
                           .Arg<jaxfuse::F32Buffer>()            // c0
                           .Arg<xla::ffi::Buffer<xla::ffi::DataType::S32>>()  // lengths
                           .Ret<xla::ffi::AnyBuffer>()           // y
                           .Ret<jaxfuse::F32Buffer>()            // h_n
                           .Ret<jaxfuse::F32Buffer>()            // c_n
                           .Ret<jaxfuse::F32Buffer>()            // gates
                           .Ret<jaxfuse::F32Buffer>()            // states
                           .Ret<xla::ffi::AnyBuffer>()           // exchange
                           .Ret<xla::ffi::Buffer<xla::ffi::DataType::U32>>())  // sync
        .Attr<int64_t>("save"),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxfuseRnnBackward, jaxfuse::RnnBackwardImpl,
    jaxfuse::with_plan(xla::ffi::Ffi::Bind()
                           .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                           .Arg<xla::ffi::AnyBuffer>()           // dy
                           .Arg<jaxfuse::F32Buffer>()            // dh_n
                           .Arg<jaxfuse::F32Buffer>()            // dc_n
                           .Arg<jaxfuse::F32Buffer>()            // gates
                           .Arg<jaxfuse::F32Buffer>()            // states
                           .Arg<jaxfuse::F32Buffer>()            // h0
                           .Arg<jaxfuse::F32Buffer>()            // c0
                           .Arg<xla::ffi::AnyBuffer>()           // w_hh
                           .Arg<xla::ffi::Buffer<xla::ffi::DataType::S32>>()  // lengths
                           .Ret<jaxfuse::F32Buffer>()            // dxp
                           .Ret<jaxfuse::F32Buffer>()            // dhn
                           .Ret<jaxfuse::F32Buffer>()            // dh0
                           .Ret<jaxfuse::F32Buffer>()            // dc0
                           .Ret<xla::ffi::AnyBuffer>()           // exchange
                           .Ret<xla::ffi::Buffer<xla::ffi::DataType::U32>>()),  // sync
    {xla::ffi::Traits::kCmdBufferCompatible});

// For the Python side, which plans launches at trace time: the SM count and the shared memory
// a CTA may opt into on the current GPU.
extern "C" int jaxfuse_rnn_device(int* sms, int* shared_bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess)
    return 0;
  return 1;
}
