// pybind11 entry point of flashdmoe_nvshmem, the module built with relocatable device code and linked
// against NVSHMEM's device library (device code) and the nvidia-nvshmem wheel's host library, the one
// nvshmem4py loads: one NVSHMEM instance per process. Raw pointers and the stream handle in, no libtorch.
//
// Device state: the host library is initialised by nvshmem4py (Team.nvshmem), so this module never calls
// nvshmem_init. Its own copy of the device state (nvshmemi_device_state_d, linked in from
// libnvshmem_device.a) is bound by nvshmemx_collective_launch_query_gridsize / nvshmemx_collective_launch:
// both first call the device library's nvshmemi_check_state_and_init_d, which, with the host library
// initialised, registers this module's state with it (nvshmemid_hostlib_init_attr + the module's callback)
// and fills it. init_device_state() does that once, before any kernel of this module runs.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "nvshmem/smoke.cuh"

namespace py = pybind11;

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

void require_initialised_host() {
  const int status = nvshmemx_init_status();
  if (status < NVSHMEM_STATUS_IS_INITIALIZED) {
    throw std::runtime_error(
        "NVSHMEM is not initialised in this process (nvshmemx_init_status() = " + std::to_string(status) +
        "): join a team first (flashdmoe.Team.nvshmem, i.e. nvshmem.core.init), then use flashdmoe_nvshmem");
  }
}

bool device_state_bound = false;

// Binds this module's device state to the running NVSHMEM instance (see the file comment). Idempotent.
// Returns the grid nvshmemx_collective_launch_query_gridsize allows for the smoke kernel (> 0).
int init_device_state() {
  require_initialised_host();
  int grid = 0;
  const int status = nvshmemx_collective_launch_query_gridsize(
      reinterpret_cast<const void*>(&flashdmoe::comm::smoke_kernel), dim3(32), nullptr, 0, &grid);
  if (status != 0 || grid <= 0)
    throw std::runtime_error("nvshmemx_collective_launch_query_gridsize failed (status " + std::to_string(status) +
                             ", grid " + std::to_string(grid) + "): this module's NVSHMEM device state is not bound");
  device_state_bound = true;
  return grid;
}

void smoke(uintptr_t send, uintptr_t recv, int words, uintptr_t signal, uint64_t sequence, uint64_t timeout_ns,
           uintptr_t result, uintptr_t stream) {
  if (!device_state_bound) throw std::runtime_error("smoke: call init_device_state() first");
  if (words <= 0) throw std::invalid_argument("smoke: words must be positive, got " + std::to_string(words));
  if (sequence == 0) throw std::invalid_argument("smoke: sequence must be > 0 (signals start at 0)");
  if (!send || !recv || !signal || !result) throw std::invalid_argument("smoke: null pointer argument");
  flashdmoe::comm::smoke_kernel<<<1, 32, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<uint32_t*>(send), reinterpret_cast<uint32_t*>(recv), words,
      reinterpret_cast<uint64_t*>(signal), sequence, timeout_ns, reinterpret_cast<unsigned long long*>(result));
  check_cuda(cudaGetLastError(), "smoke kernel launch");
}

}  // namespace

PYBIND11_MODULE(flashdmoe_nvshmem, m) {
  m.doc() = "flashdmoe's NVSHMEM device-API transport (relocatable device code, libnvshmem_device)";
  m.def("init_status", [] { return nvshmemx_init_status(); },
        "nvshmemx_init_status() of the process's NVSHMEM host library (2: initialised)");
  m.def("host_my_pe", [] { require_initialised_host(); return nvshmem_my_pe(); });
  m.def("host_n_pes", [] { require_initialised_host(); return nvshmem_n_pes(); });
  m.def("init_device_state", &init_device_state,
        "bind this module's NVSHMEM device state to the NVSHMEM instance nvshmem4py started");
  m.def("smoke", &smoke, py::arg("send"), py::arg("recv"), py::arg("words"), py::arg("signal"),
        py::arg("sequence"), py::arg("timeout_ns"), py::arg("result"), py::arg("stream"));
  m.attr("SMOKE_SLOTS") = static_cast<int>(flashdmoe::comm::kSmokeSlots);
  m.attr("NVSHMEM_VERSION") = py::make_tuple(NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                             NVSHMEM_VENDOR_PATCH_VERSION);
}
