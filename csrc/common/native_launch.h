// The one C entry point the kernel module hands to the host launch queue (csrc/host/launch_queue.cpp):
// a forward launched from C++ without a Python call in between. Plain C types only: the two modules are
// built by different compilers against different libraries (the kernel module links no libtorch) and
// meet through a PyCapsule holding a NativeForwardEntry.
#pragma once
#include <cstddef>
#include <cstdint>

namespace flashdmoe {

// A capsule's name must match on both sides.
constexpr const char* kNativeForwardCapsule = "flashdmoe.native_forward";

enum NativeLaunchResult : int {
  kNativeLaunchOk = 0,
  kNativeLaunchInvalidArgument = 1,  // raised as ValueError
  kNativeLaunchError = 2,            // raised as RuntimeError
};

struct NativeForwardEntry {
  // Launch a prepared forward (the PreparedForward at `prepared`): `addresses` as `launch` takes them,
  // `info` receives (grid, blocks per SM, shared memory bytes), `error` a message on failure.
  int (*launch)(void* prepared, const uintptr_t* addresses, size_t address_count, uint32_t sequence,
                uintptr_t stream, uintptr_t status_host, int* info, char* error, size_t error_bytes);
  // 1 while `stream` captures a CUDA graph, 0 when it does not, -1 when CUDA cannot say (the queue then
  // leaves the call to the Python path, which asks torch).
  int (*capturing)(uintptr_t stream);
};

}  // namespace flashdmoe
