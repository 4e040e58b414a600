// Fused snapshot pack + checksum kernels for megatron-deadpool.
//
// pack:     copy every tensor of a rank's shard to its 16-byte aligned offset in one flat
//           uint8 buffer, zero the gaps, and checksum the packed region - one read of the
//           sources, one write of the buffer, no second pass.
// unpack:   the inverse; checksums the flat buffer while scattering it back.
// checksum: the checksum alone.
//
// Checksum (the definition and its proof are in megatron_deadpool/replication/pack.py): the
// buffer is n little-endian words, w_i each read as a signed int32, and
//     checksum = sum_{i<n} (i + 1) * w_i  mod 2**64.
// Everything is computed in uint64, whose wraparound is exactly arithmetic mod 2**64, so the
// order of the (atomic) additions does not matter and the result is bit-identical to the
// exact-integer torch fallback.
//
// Work split: thread t handles the 16-byte vectors t, t + S, t + 2S, ... (S = threads in the
// grid), kUnroll of them per loop trip so several loads are in flight. A vector never spans
// two tensors because offsets are multiples of 16; it may end in a tensor's zero padding.
// Each thread sums its terms, the block reduces with warp shuffles, one atomicAdd per block.
// This file has no torch dependency: binding.cpp owns the tensors and calls the launchers.

#include <cuda_runtime.h>

#include <cstdint>

#include "pack_checksum.h"

#define DP_HD __host__ __device__ __forceinline__

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// The signed value of a 32-bit word, as a uint64 modulo 2**64 (well defined, no casts of
// out-of-range values to signed types).
DP_HD unsigned long long signed_word(uint32_t bits) {
  unsigned long long value = bits;
  return (bits & 0x80000000u) ? value - (1ull << 32) : value;
}

// (i + 1) * w_i summed over the four words of 16-byte vector number `vec` (mod 2**64).
DP_HD unsigned long long vector_term(uint4 v, int64_t vec) {
  const unsigned long long first = static_cast<unsigned long long>(vec) * 4ull + 1ull;
  return first * signed_word(v.x) + (first + 1ull) * signed_word(v.y) +
         (first + 2ull) * signed_word(v.z) + (first + 3ull) * signed_word(v.w);
}

DP_HD unsigned long long word_term(uint32_t bits, int64_t index) {
  return (static_cast<unsigned long long>(index) + 1ull) * signed_word(bits);
}

DP_HD uint32_t byte_word(const uint8_t* p, int count) {
  uint32_t word = 0;
  for (int j = 0; j < count && j < 4; ++j) word |= static_cast<uint32_t>(p[j]) << (8 * j);
  return word;
}

// Load `count` (0..16) bytes at p as a little-endian vector, zero-filled beyond count. On the
// device whole aligned vectors take one 16-byte (or four 4-byte) loads; the host emulation
// always goes byte by byte, which is well defined for any alignment.
DP_HD uint4 load_bytes(const uint8_t* p, int count) {
#ifdef __CUDA_ARCH__
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if (count == 16 && (addr & 15u) == 0) return *reinterpret_cast<const uint4*>(p);
  if (count == 16 && (addr & 3u) == 0) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
#endif
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (count > 0) v.x = byte_word(p, count);
  if (count > 4) v.y = byte_word(p + 4, count - 4);
  if (count > 8) v.z = byte_word(p + 8, count - 8);
  if (count > 12) v.w = byte_word(p + 12, count - 12);
  return v;
}

DP_HD void store_word_bytes(uint8_t* p, uint32_t word, int count) {
  for (int j = 0; j < count && j < 4; ++j) p[j] = static_cast<uint8_t>(word >> (8 * j));
}

// Store the first `count` (0..16) bytes of v at p (same fast paths as load_bytes).
DP_HD void store_bytes(uint8_t* p, uint4 v, int count) {
#ifdef __CUDA_ARCH__
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if (count == 16 && (addr & 15u) == 0) {
    *reinterpret_cast<uint4*>(p) = v;
    return;
  }
  if (count == 16 && (addr & 3u) == 0) {
    uint32_t* w = reinterpret_cast<uint32_t*>(p);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
    return;
  }
#endif
  if (count > 0) store_word_bytes(p, v.x, count);
  if (count > 4) store_word_bytes(p + 4, v.y, count - 4);
  if (count > 8) store_word_bytes(p + 8, v.z, count - 8);
  if (count > 12) store_word_bytes(p + 12, v.w, count - 12);
}

// The last segment s >= hint with offset <= o. Requires segs[hint].offset <= o; a thread's
// vectors only move forward, so its previous answer is a valid hint.
DP_HD int find_segment(const DpSegment* segs, int nsegs, int64_t o, int hint) {
  int lo = hint;
  if (lo + 1 >= nsegs || segs[lo + 1].offset > o) return lo;
  int hi = nsegs - 1;
  if (segs[hi].offset <= o) return hi;
  while (hi - lo > 1) {  // segs[lo].offset <= o < segs[hi].offset
    const int mid = lo + (hi - lo) / 2;
    if (segs[mid].offset <= o) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Bytes of segment `seg` that fall in the vector at packed offset o: (source pointer, count).
DP_HD int segment_bytes(const DpSegment& seg, int64_t o, const uint8_t** src) {
  const int64_t local = o - seg.offset;
  const int64_t remaining = seg.nbytes - local;
  *src = reinterpret_cast<const uint8_t*>(seg.addr) + local;
  return remaining >= 16 ? 16 : (remaining > 0 ? static_cast<int>(remaining) : 0);
}

// Per-vector bodies shared by the kernels and the host emulation.
DP_HD uint4 pack_load(const DpSegment* segs, int nsegs, int64_t vec, int* hint) {
  const int64_t o = vec * 16;
  *hint = find_segment(segs, nsegs, o, *hint);
  const uint8_t* src = nullptr;
  const int count = segment_bytes(segs[*hint], o, &src);
  return load_bytes(src, count);
}

DP_HD void unpack_vector(const DpSegment* segs, int nsegs, uint4 v, int64_t vec, int* hint) {
  const int64_t o = vec * 16;
  *hint = find_segment(segs, nsegs, o, *hint);
  const uint8_t* src = nullptr;
  const int count = segment_bytes(segs[*hint], o, &src);
  store_bytes(const_cast<uint8_t*>(src), v, count);
}

__device__ __forceinline__ void block_add(unsigned long long value, unsigned long long* result) {
  __shared__ unsigned long long partial[kThreads / 32];
  for (int delta = 16; delta > 0; delta >>= 1) value += __shfl_down_sync(0xffffffffu, value, delta);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kThreads / 32 ? partial[lane] : 0ull;
    for (int delta = 16; delta > 0; delta >>= 1) {
      value += __shfl_down_sync(0xffffffffu, value, delta);
    }
    if (lane == 0) atomicAdd(result, value);
  }
}

__global__ void __launch_bounds__(kThreads)
    pack_kernel(const DpSegment* __restrict__ segs, int nsegs, uint8_t* __restrict__ out,
                int64_t nvec, unsigned long long* __restrict__ result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  unsigned long long acc = 0ull;
  int hint = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < nvec;
       base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight
      const int64_t vec = base + u * stride;
      v[u] = vec < nvec ? pack_load(segs, nsegs, vec, &hint) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      if (vec < nvec) {
        store_bytes(out + vec * 16, v[u], 16);
        acc += vector_term(v[u], vec);
      }
    }
  }
  block_add(acc, result);
}

__global__ void __launch_bounds__(kThreads)
    unpack_kernel(const uint8_t* __restrict__ flat, const DpSegment* __restrict__ segs,
                  int nsegs, int64_t nvec, unsigned long long* __restrict__ result) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  unsigned long long acc = 0ull;
  int hint = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; base < nvec;
       base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight
      const int64_t vec = base + u * stride;
      v[u] = vec < nvec ? load_bytes(flat + vec * 16, 16) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      if (vec < nvec) {
        acc += vector_term(v[u], vec);
        unpack_vector(segs, nsegs, v[u], vec, &hint);
      }
    }
  }
  block_add(acc, result);
}

__global__ void __launch_bounds__(kThreads)
    checksum_kernel(const uint8_t* __restrict__ buf, int64_t nbytes,
                    unsigned long long* __restrict__ result) {
  const int64_t nvec = nbytes / 16;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  unsigned long long acc = 0ull;
  for (int64_t base = tid; base < nvec; base += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      v[u] = vec < nvec ? load_bytes(buf + vec * 16, 16) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t vec = base + u * stride;
      if (vec < nvec) acc += vector_term(v[u], vec);
    }
  }
  if (tid == 0) {  // the 0-3 words after the last whole vector
    for (int64_t word = nvec * 4; word < nbytes / 4; ++word) {
      acc += word_term(byte_word(buf + word * 4, 4), word);
    }
  }
  block_add(acc, result);
}

// Blocks for `nvec` vectors: one per kThreads vectors, capped at what fits on the device at
// once (SMs x resident blocks per SM for this kernel, from the occupancy API: register and
// shared-memory use decide it, e.g. 5 blocks of 256 threads at 48 registers, not a guess).
// Grid-stride loops cover the rest.
template <typename Kernel>
int grid_for(Kernel kernel, int64_t nvec) {
  int device = 0;
  int sms = 0;
  int per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    sms = 1;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) !=
          cudaSuccess ||
      per_sm <= 0) {
    per_sm = 1;
  }
  const int64_t wanted = (nvec + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * per_sm;
  return static_cast<int>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

}  // namespace

int dp_launch_pack(const DpSegment* segments, int nsegments, uint8_t* out, int64_t total,
                   unsigned long long* result, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(result, 0, sizeof(unsigned long long), s);
  if (err != cudaSuccess || total == 0) return static_cast<int>(err);
  const int64_t nvec = total / 16;
  pack_kernel<<<grid_for(pack_kernel, nvec), kThreads, 0, s>>>(segments, nsegments, out, nvec,
                                                                 result);
  return static_cast<int>(cudaGetLastError());
}

int dp_launch_unpack(const uint8_t* flat, const DpSegment* segments, int nsegments,
                     int64_t total, unsigned long long* result, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(result, 0, sizeof(unsigned long long), s);
  if (err != cudaSuccess || total == 0) return static_cast<int>(err);
  const int64_t nvec = total / 16;
  unpack_kernel<<<grid_for(unpack_kernel, nvec), kThreads, 0, s>>>(flat, segments, nsegments,
                                                                   nvec, result);
  return static_cast<int>(cudaGetLastError());
}

int dp_launch_checksum(const uint8_t* buf, int64_t nbytes, unsigned long long* result,
                       void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(result, 0, sizeof(unsigned long long), s);
  if (err != cudaSuccess || nbytes < 4) return static_cast<int>(err);
  checksum_kernel<<<grid_for(checksum_kernel, nbytes / 16), kThreads, 0, s>>>(buf, nbytes,
                                                                                result);
  return static_cast<int>(cudaGetLastError());
}

const char* dp_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

unsigned long long dp_emulate_pack(const DpSegment* segments, int nsegments, uint8_t* out,
                                   int64_t total) {
  unsigned long long acc = 0ull;
  int hint = 0;
  for (int64_t vec = 0; vec < total / 16; ++vec) {
    const uint4 v = pack_load(segments, nsegments, vec, &hint);
    store_bytes(out + vec * 16, v, 16);
    acc += vector_term(v, vec);
  }
  return acc;
}

unsigned long long dp_emulate_unpack(const uint8_t* flat, const DpSegment* segments,
                                     int nsegments, int64_t total) {
  unsigned long long acc = 0ull;
  int hint = 0;
  for (int64_t vec = 0; vec < total / 16; ++vec) {
    const uint4 v = load_bytes(flat + vec * 16, 16);
    acc += vector_term(v, vec);
    unpack_vector(segments, nsegments, v, vec, &hint);
  }
  return acc;
}

unsigned long long dp_emulate_checksum(const uint8_t* buf, int64_t nbytes) {
  unsigned long long acc = 0ull;
  const int64_t nvec = nbytes / 16;
  for (int64_t vec = 0; vec < nvec; ++vec) acc += vector_term(load_bytes(buf + vec * 16, 16), vec);
  for (int64_t word = nvec * 4; word < nbytes / 4; ++word) {
    acc += word_term(byte_word(buf + word * 4, 4), word);
  }
  return acc;
}
