// pybind11 entry point of flashdmoe_nvshmem, the module built with relocatable device code and linked
// against NVSHMEM's device library (device code) and the nvidia-nvshmem wheel's host library, the one
// nvshmem4py loads: one NVSHMEM instance per process. Raw pointers and the stream handle in, no libtorch.
//
// Device state: every module linked with libnvshmem_device.a has its own copy of NVSHMEM's device state
// (nvshmemi_device_state_d, __constant__), which stays zero until the host library copies its state into
// it: nvshmem_my_pe() and nvshmem_n_pes() then read 0 and every put dereferences a null peer-base table
// (an illegal address). The host library fills the states registered with it. This module's is registered
// by the device library's nvshmemi_init_thread (behind the inline nvshmem_init / nvshmemx_init_attr): it
// passes nvshmemid_hostlib_init_attr a callback returning the state's address. With the host library
// already initialised (by nvshmem4py), that call skips bootstrap and heap setup (the symmetric heap and
// nvshmem4py's pointers stay as they are), and nvshmemi_update_device_state registers the state, counts
// one more initialisation and copies the host's state into it. nvshmem_finalize (nvshmemi_finalize)
// unregisters it and drops that count, so nvshmem4py's own finalize is still the last one.
// (nvshmemi_check_state_and_init_d, which nvshmemx_collective_launch calls, passes no callback once the
// host library is initialised: it binds nothing here. nvshmemx_cumodule_init does the same registration
// for modules loaded through the driver API, which this one is not.)
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
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

__global__ void device_pes_kernel(int* out) {
  out[0] = nvshmem_my_pe();
  out[1] = nvshmem_n_pes();
}

// (my_pe, n_pes) as this module's kernels see them: the check that the device state is bound.
py::tuple device_pes() {
  int* out = nullptr;
  check_cuda(cudaMalloc(&out, 2 * sizeof(int)), "device_pes: cudaMalloc");
  int host[2] = {-1, -1};
  device_pes_kernel<<<1, 1>>>(out);
  cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) status = cudaMemcpy(host, out, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(out);
  check_cuda(status, "device_pes kernel");
  return py::make_tuple(host[0], host[1]);
}

// Registers this module's device state with the NVSHMEM instance nvshmem4py started (see the file
// comment). `uid`: the team's 128-byte unique id, which the host library ignores once bootstrapped (every
// rank still calls this, so a future NVSHMEM that does bootstrap again finds all ranks there). `check`:
// run the one-thread kernel that must see the host's PE and PE count. Returns the thread support level.
int init_device_state(py::bytes uid, int rank, int nranks, bool check) {
  require_initialised_host();
  if (device_state_bound) throw std::runtime_error("init_device_state: already bound; call finalize_device_state() first");
  const std::string id_bytes = uid;
  nvshmemx_uniqueid_t id;
  if (id_bytes.size() != sizeof(id))
    throw std::invalid_argument("uid: expected " + std::to_string(sizeof(id)) + " bytes, got " + std::to_string(id_bytes.size()));
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw std::invalid_argument("rank/nranks: expected 0 <= rank < nranks, got " + std::to_string(rank) + "/" + std::to_string(nranks));
  std::memcpy(&id, id_bytes.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr) != 0)
    throw std::runtime_error("nvshmemx_set_attr_uniqueid_args failed");
  nvshmemx_init_init_attr_ver_only(attr);
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  // nvshmemx_init_attr without its exit(-1) on failure: the error becomes a Python exception.
  const int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr,
                                          version);
  if (status != 0) throw std::runtime_error("NVSHMEM initialisation of flashdmoe_nvshmem failed (status " + std::to_string(status) + ")");
  device_state_bound = true;
  if (!check) return provided;
  const py::tuple pes = device_pes();
  if (pes[0].cast<int>() != nvshmem_my_pe() || pes[1].cast<int>() != nvshmem_n_pes())
    throw std::runtime_error("flashdmoe_nvshmem's device state is not the running NVSHMEM instance's: device sees PE " +
                             std::to_string(pes[0].cast<int>()) + " of " + std::to_string(pes[1].cast<int>()) +
                             ", host " + std::to_string(nvshmem_my_pe()) + " of " + std::to_string(nvshmem_n_pes()));
  return provided;
}

// The finalize matching init_device_state (before nvshmem4py's own finalize). Idempotent.
void finalize_device_state() {
  if (!device_state_bound) return;
  device_state_bound = false;
  nvshmem_finalize();
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
  m.def("init_device_state", &init_device_state, py::arg("uid"), py::arg("rank"), py::arg("nranks"),
        py::arg("check") = true,
        "register this module's NVSHMEM device state with the instance nvshmem4py started (collective)");
  m.def("finalize_device_state", &finalize_device_state, "the finalize matching init_device_state");
  m.def("device_state_bound", [] { return device_state_bound; });
  m.def("device_pes", &device_pes, "(my_pe, n_pes) as this module's kernels see them");
  m.def("smoke", &smoke, py::arg("send"), py::arg("recv"), py::arg("words"), py::arg("signal"),
        py::arg("sequence"), py::arg("timeout_ns"), py::arg("result"), py::arg("stream"));
  m.attr("SMOKE_SLOTS") = static_cast<int>(flashdmoe::comm::kSmokeSlots);
  m.attr("NVSHMEM_VERSION") = py::make_tuple(NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                             NVSHMEM_VENDOR_PATCH_VERSION);
}
