// Launchers of the fused snapshot pack + checksum kernels (see pack_checksum.cu).
//
// This header is plain C++ (no CUDA or torch headers) so that the torch binding and the CUDA
// translation unit share it. Checksum definition:
// megatron_deadpool/replication/pack.py.
#pragma once

#include <cstdint>

// One tensor of the packed region: its bytes [0, nbytes) live at address `addr` and go to
// bytes [offset, offset + nbytes) of the packed buffer. Tables are sorted by offset, offsets
// are multiples of 16, and segments with nbytes == 0 are left out.
struct DpSegment {
  int64_t addr;
  int64_t offset;
  int64_t nbytes;
};

static_assert(sizeof(DpSegment) == 24, "DpSegment must be three packed int64 values");

// GPU launchers. `segments` and `result` are device pointers; `stream` is a cudaStream_t.
// Each zeroes *result, enqueues the work and returns a cudaError_t (0 = success). The
// checksum (mod 2**64) is in *result once the stream reaches that point.
int dp_launch_pack(const DpSegment* segments, int nsegments, uint8_t* out, int64_t total,
                   unsigned long long* result, void* stream);
int dp_launch_unpack(const uint8_t* flat, const DpSegment* segments, int nsegments,
                     int64_t total, unsigned long long* result, void* stream);
int dp_launch_checksum(const uint8_t* buf, int64_t nbytes, unsigned long long* result,
                       void* stream);
const char* dp_error_string(int code);

// Host emulation: the same per-vector code as the kernels, run serially on host memory.
// Lets a machine without a GPU check the kernels' arithmetic against the torch fallback.
unsigned long long dp_emulate_pack(const DpSegment* segments, int nsegments, uint8_t* out,
                                   int64_t total);
unsigned long long dp_emulate_unpack(const uint8_t* flat, const DpSegment* segments,
                                     int nsegments, int64_t total);
unsigned long long dp_emulate_checksum(const uint8_t* buf, int64_t nbytes);
