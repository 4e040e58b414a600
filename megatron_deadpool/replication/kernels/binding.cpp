// Python binding of the fused pack + checksum kernels: the module `deadpool_cuda_kernels`.
//
// Called only through megatron_deadpool/replication/pack.py, which validates the arguments,
// computes the layout (offsets, total), holds the device guard and passes the CUDA stream to
// run on (torch's current stream, as an integer). The GPU entry points only enqueue work:
// the segment table is built once per layout (`segment_table`, moved to the device by
// pack.py) and the checksum lands in a caller-owned device slot, so a capture never makes the
// host wait (no pageable copy, no `.item()`); pack.py reads the slot when it needs the value.
// This file needs no c10/cuda headers and also builds against a CPU-only torch, where the
// emulate_* functions (the kernels' per-vector code run serially on host tensors) let tests
// check the kernel arithmetic without a GPU.
//
// Checksums are uint64 values; the device slot holds their bits as an int64, the emulate_*
// functions return them as a signed int64 (two's complement); pack.py maps both to
// [0, 2**64).

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters; lighter than
                                      // torch/extension.h, which pulls in all of libtorch's API

#include <cstdint>
#include <cstring>
#include <vector>

#include "pack_checksum.h"

namespace {

constexpr int64_t kAbi = 2;  // megatron_deadpool.replication.pack.EXTENSION_ABI

void check_flat(const at::Tensor& buf, const char* role) {
  TORCH_CHECK(buf.scalar_type() == at::kByte, role, " must be a uint8 tensor");
  TORCH_CHECK(buf.dim() == 1 && buf.is_contiguous(), role, " must be 1-D and contiguous");
}

// The segment table of `tensors` (empty tensors left out), checked against the layout.
std::vector<DpSegment> segments_of(const std::vector<at::Tensor>& tensors,
                                   const std::vector<int64_t>& offsets, int64_t total,
                                   const at::Device& device) {
  TORCH_CHECK(tensors.size() == offsets.size(), "got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  TORCH_CHECK(total >= 0 && total % 16 == 0, "packed size ", total, " is not a multiple of 16");
  std::vector<DpSegment> segments;
  int64_t end = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device() == device, "tensor ", i, " is on ", t.device(), ", expected ",
                device);
    TORCH_CHECK(t.is_contiguous(), "tensor ", i, " is not contiguous");
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    TORCH_CHECK(offsets[i] % 16 == 0 && offsets[i] >= end, "offset ", offsets[i],
                " of tensor ", i, " is not 16-aligned after the previous tensor");
    end = offsets[i] + nbytes;
    TORCH_CHECK(end <= total, "tensor ", i, " ends at ", end, " beyond the packed size ", total);
    if (nbytes > 0) {
      segments.push_back(
          {static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())), offsets[i], nbytes});
    }
  }
  return segments;
}

// The segment table of `tensors` as a CPU int64 tensor [n, 3] (addr, offset, nbytes).
at::Tensor segment_table(const std::vector<at::Tensor>& tensors,
                         const std::vector<int64_t>& offsets, int64_t total) {
  const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  const auto segments = segments_of(tensors, offsets, total, device);
  const int64_t n = static_cast<int64_t>(segments.size());
  at::Tensor table = at::empty({n, 3}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) std::memcpy(table.data_ptr<int64_t>(), segments.data(), n * sizeof(DpSegment));
  return table;
}

const DpSegment* table_ptr(const at::Tensor& table) {
  return reinterpret_cast<const DpSegment*>(table.data_ptr<int64_t>());
}

void check_table(const at::Tensor& table, const at::Tensor& like) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 3 &&
                  table.is_contiguous(),
              "table must be a contiguous int64 tensor [n, 3] (segment_table)");
  TORCH_CHECK(table.device() == like.device(), "table is on ", table.device(), ", expected ",
              like.device());
}

unsigned long long* result_ptr(at::Tensor& result, const at::Tensor& like) {
  TORCH_CHECK(result.scalar_type() == at::kLong && result.numel() >= 1 && result.is_contiguous(),
              "result must be a contiguous int64 tensor with at least one element");
  TORCH_CHECK(result.device() == like.device(), "result is on ", result.device(),
              ", expected ", like.device());
  return reinterpret_cast<unsigned long long*>(result.data_ptr<int64_t>());
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

void launched(int code, const char* what) {
  TORCH_CHECK(code == 0, what, " launch failed: ", dp_error_string(code));
}

// Enqueue: pack the table's segments into out[0:total], checksum into result[0].
void pack(const at::Tensor& table, at::Tensor out, int64_t total, at::Tensor result,
          int64_t stream) {
  check_flat(out, "out");
  TORCH_CHECK(out.is_cuda(), "out must be a CUDA tensor");
  TORCH_CHECK(out.numel() >= total, "out has ", out.numel(), " B, needs ", total);
  TORCH_CHECK(total % 16 == 0, "packed size ", total, " is not a multiple of 16");
  check_table(table, out);
  launched(dp_launch_pack(table_ptr(table), static_cast<int>(table.size(0)),
                          out.data_ptr<uint8_t>(), total, result_ptr(result, out),
                          as_stream(stream)),
           "pack");
}

// Enqueue: scatter flat[0:total] into the table's segments, checksum into result[0].
void unpack(at::Tensor flat, const at::Tensor& table, int64_t total, at::Tensor result,
            int64_t stream) {
  check_flat(flat, "flat");
  TORCH_CHECK(flat.is_cuda(), "flat must be a CUDA tensor");
  TORCH_CHECK(flat.numel() >= total, "flat has ", flat.numel(), " B, needs ", total);
  TORCH_CHECK(total % 16 == 0, "packed size ", total, " is not a multiple of 16");
  check_table(table, flat);
  launched(dp_launch_unpack(flat.data_ptr<uint8_t>(), table_ptr(table),
                            static_cast<int>(table.size(0)), total, result_ptr(result, flat),
                            as_stream(stream)),
           "unpack");
}

// Enqueue: checksum of buf into result[0].
void checksum(at::Tensor buf, at::Tensor result, int64_t stream) {
  check_flat(buf, "buf");
  TORCH_CHECK(buf.is_cuda(), "buf must be a CUDA tensor");
  TORCH_CHECK(buf.numel() % 4 == 0, "buf length ", buf.numel(), " is not a multiple of 4");
  launched(dp_launch_checksum(buf.data_ptr<uint8_t>(), buf.numel(), result_ptr(result, buf),
                              as_stream(stream)),
           "checksum");
}

// Host emulation (CPU tensors): same per-vector code as the kernels, run serially.
int64_t emulate_pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
                     at::Tensor out, int64_t total) {
  check_flat(out, "out");
  TORCH_CHECK(out.is_cpu(), "emulate_pack runs on CPU tensors");
  TORCH_CHECK(out.numel() >= total, "out has ", out.numel(), " B, needs ", total);
  const auto segments = segments_of(tensors, offsets, total, out.device());
  return static_cast<int64_t>(dp_emulate_pack(
      segments.data(), static_cast<int>(segments.size()), out.data_ptr<uint8_t>(), total));
}

int64_t emulate_unpack(at::Tensor flat, const std::vector<at::Tensor>& tensors,
                       const std::vector<int64_t>& offsets, int64_t total) {
  check_flat(flat, "flat");
  TORCH_CHECK(flat.is_cpu(), "emulate_unpack runs on CPU tensors");
  TORCH_CHECK(flat.numel() >= total, "flat has ", flat.numel(), " B, needs ", total);
  const auto segments = segments_of(tensors, offsets, total, flat.device());
  return static_cast<int64_t>(dp_emulate_unpack(
      flat.data_ptr<uint8_t>(), segments.data(), static_cast<int>(segments.size()), total));
}

int64_t emulate_checksum(at::Tensor buf) {
  check_flat(buf, "buf");
  TORCH_CHECK(buf.is_cpu(), "emulate_checksum runs on CPU tensors");
  TORCH_CHECK(buf.numel() % 4 == 0, "buf length ", buf.numel(), " is not a multiple of 4");
  return static_cast<int64_t>(dp_emulate_checksum(buf.data_ptr<uint8_t>(), buf.numel()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused snapshot pack + checksum kernels for megatron-deadpool (see pack.py)";
  m.attr("ABI") = kAbi;
  m.def("segment_table", &segment_table, "CPU int64 [n, 3] segment table of tensors at offsets",
        py::arg("tensors"), py::arg("offsets"), py::arg("total"));
  m.def("pack", &pack, "Enqueue: pack the table's tensors into out; checksum into result[0]",
        py::arg("table"), py::arg("out"), py::arg("total"), py::arg("result"), py::arg("stream"));
  m.def("unpack", &unpack, "Enqueue: scatter flat into the table's tensors; checksum into result",
        py::arg("flat"), py::arg("table"), py::arg("total"), py::arg("result"), py::arg("stream"));
  m.def("checksum", &checksum, "Enqueue: checksum of a uint8 buffer into result[0]",
        py::arg("buf"), py::arg("result"), py::arg("stream"));
  m.def("emulate_pack", &emulate_pack, "Host emulation of pack (CPU tensors)");
  m.def("emulate_unpack", &emulate_unpack, "Host emulation of unpack (CPU tensors)");
  m.def("emulate_checksum", &emulate_checksum, "Host emulation of checksum (CPU tensors)");
}
