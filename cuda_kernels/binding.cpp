// Python binding of the fused pack + checksum kernels: the module `deadpool_cuda_kernels`.
//
// Called only through megatron_deadpool/pack.py, which validates the arguments, computes the
// layout (offsets, total) and passes the CUDA stream to run on (torch's current stream, as
// an integer) and holds the device guard. This file therefore needs no c10/cuda headers and
// also builds against a CPU-only torch, where the emulate_* functions (the kernels' per-vector
// code run serially on host tensors) let tests check the kernel arithmetic without a GPU.
//
// Each function returns the checksum as a signed int64 (two's complement of the uint64
// value); pack.py maps it back to [0, 2**64).

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters; lighter than
                                      // torch/extension.h, which pulls in all of libtorch's API

#include <cstdint>
#include <cstring>
#include <vector>

#include "pack_checksum.h"

namespace {

constexpr int64_t kAbi = 1;  // megatron_deadpool.pack.EXTENSION_ABI

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

at::Tensor device_table(const std::vector<DpSegment>& segments, const at::Device& device) {
  const int64_t n = static_cast<int64_t>(segments.size());
  at::Tensor table = at::empty({n > 0 ? n : 1, 3}, at::TensorOptions().dtype(at::kLong));
  if (n > 0) std::memcpy(table.data_ptr<int64_t>(), segments.data(), n * sizeof(DpSegment));
  return table.to(device);
}

const DpSegment* table_ptr(const at::Tensor& table) {
  return reinterpret_cast<const DpSegment*>(table.data_ptr<int64_t>());
}

int64_t finish(int code, const at::Tensor& result, const char* what) {
  TORCH_CHECK(code == 0, what, " launch failed: ", dp_error_string(code));
  return result.item<int64_t>();  // waits for the kernel (same stream)
}

at::Tensor result_slot(const at::Tensor& like) {
  return at::empty({1}, like.options().dtype(at::kLong));
}

unsigned long long* result_ptr(at::Tensor& result) {
  return reinterpret_cast<unsigned long long*>(result.data_ptr<int64_t>());
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

int64_t pack(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
             at::Tensor out, int64_t total, int64_t stream) {
  check_flat(out, "out");
  TORCH_CHECK(out.is_cuda(), "out must be a CUDA tensor");
  TORCH_CHECK(out.numel() >= total, "out has ", out.numel(), " B, needs ", total);
  const auto segments = segments_of(tensors, offsets, total, out.device());
  if (total == 0) return 0;
  at::Tensor table = device_table(segments, out.device());
  at::Tensor result = result_slot(out);
  const int code = dp_launch_pack(table_ptr(table), static_cast<int>(segments.size()),
                                  out.data_ptr<uint8_t>(), total, result_ptr(result),
                                  as_stream(stream));
  return finish(code, result, "pack");
}

int64_t unpack(at::Tensor flat, const std::vector<at::Tensor>& tensors,
               const std::vector<int64_t>& offsets, int64_t total, int64_t stream) {
  check_flat(flat, "flat");
  TORCH_CHECK(flat.is_cuda(), "flat must be a CUDA tensor");
  TORCH_CHECK(flat.numel() >= total, "flat has ", flat.numel(), " B, needs ", total);
  const auto segments = segments_of(tensors, offsets, total, flat.device());
  if (total == 0) return 0;
  at::Tensor table = device_table(segments, flat.device());
  at::Tensor result = result_slot(flat);
  const int code = dp_launch_unpack(flat.data_ptr<uint8_t>(), table_ptr(table),
                                    static_cast<int>(segments.size()), total,
                                    result_ptr(result), as_stream(stream));
  return finish(code, result, "unpack");
}

int64_t checksum(at::Tensor buf, int64_t stream) {
  check_flat(buf, "buf");
  TORCH_CHECK(buf.is_cuda(), "buf must be a CUDA tensor");
  TORCH_CHECK(buf.numel() % 4 == 0, "buf length ", buf.numel(), " is not a multiple of 4");
  if (buf.numel() == 0) return 0;
  at::Tensor result = result_slot(buf);
  const int code =
      dp_launch_checksum(buf.data_ptr<uint8_t>(), buf.numel(), result_ptr(result),
                         as_stream(stream));
  return finish(code, result, "checksum");
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
  m.def("pack", &pack, "Pack tensors at offsets into out; returns the checksum (int64 bits)",
        py::arg("tensors"), py::arg("offsets"), py::arg("out"), py::arg("total"),
        py::arg("stream"));
  m.def("unpack", &unpack, "Scatter flat back into tensors; returns the checksum of flat",
        py::arg("flat"), py::arg("tensors"), py::arg("offsets"), py::arg("total"),
        py::arg("stream"));
  m.def("checksum", &checksum, "Checksum of a uint8 buffer", py::arg("buf"), py::arg("stream"));
  m.def("emulate_pack", &emulate_pack, "Host emulation of pack (CPU tensors)");
  m.def("emulate_unpack", &emulate_unpack, "Host emulation of unpack (CPU tensors)");
  m.def("emulate_checksum", &emulate_checksum, "Host emulation of checksum (CPU tensors)");
}
