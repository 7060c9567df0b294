// flashdmoe_host: the host-side pieces of a fused forward that run in C++ (flashdmoe/kernel/host_queue.py):
// the launch queue and workspace table (launch_queue.h) and the remembered calls (call_cache.h). One
// translation unit: the module builds in seconds.
#include "host/call_cache.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace flashdmoe;
  m.doc() = "FlashDMoE's eager forward launch path in C++ (see flashdmoe/kernel/host_queue.py)";
  m.attr("READY") = static_cast<int>(kReady);
  m.attr("GROW") = static_cast<int>(kGrow);
  m.attr("ZERO") = static_cast<int>(kZero);
  py::class_<WorkspaceTable>(m, "WorkspaceTable", "Pooled workspaces: address, size and known-zero sync words")
      .def(py::init<>())
      .def("set", &WorkspaceTable::set, py::arg("device"), py::arg("stream"), py::arg("address"), py::arg("bytes"))
      .def("claim", &WorkspaceTable::claim, py::arg("device"), py::arg("stream"), py::arg("stride"),
           py::arg("sync_bytes"), py::arg("ranks"), py::arg("commit_zero") = true)
      .def("clear", &WorkspaceTable::clear);
  py::class_<NativePlan>(m, "NativePlan", "A prepared one-rank launch, as the C++ path runs it");
  m.def("native_plan", &make_plan, py::arg("launcher"), py::arg("prepared"), py::arg("workspaces"),
        py::arg("routing_words"), py::arg("routing_stride"), py::arg("stride"), py::arg("sync_bytes"),
        py::arg("stream") = py::none());
  py::class_<CallCache>(m, "CallCache", "flashdmoe.moe's remembered calls (flashdmoe/api.py)")
      .def(py::init<size_t, py::object, py::object, py::object>(), py::arg("limit"), py::arg("epoch") = py::none(),
           py::arg("status") = py::none(), py::arg("validation") = py::none())
      .def("find", &CallCache::find, "The call remembered for (x, router_weight, w1, w2, *six options), or None")
      .def("launch", &CallCache::launch,
           "(x, router_weight, w1, w2, *six options): y launched from C++, else the remembered call or None")
      .def("remember", &CallCache::remember,
           "Remember the first argument for (x, router_weight, w1, w2, *six options); False if they cannot be")
      .def("clear", &CallCache::clear)
      .def("size", &CallCache::size);
  py::class_<LaunchQueue>(m, "LaunchQueue", "Eager status slots and the launches made from C++")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("block_bytes"), py::arg("done_word"),
           py::arg("error_word"), py::arg("status_flags"), py::arg("slot_ranks"))
      .def("add_device", &LaunchQueue::add_device, py::arg("device"), py::arg("base"), py::arg("count"))
      .def("claim", &LaunchQueue::claim, py::arg("device"))
      .def("release", &LaunchQueue::release, py::arg("device"), py::arg("index"))
      .def("free_slots", &LaunchQueue::free_slots, py::arg("device"))
      .def("next_free", &LaunchQueue::next_free, py::arg("device"))
      .def("next_id", &LaunchQueue::next_id)
      .def("kept_threads", &LaunchQueue::kept_threads, "Threads whose latest launch made here is kept")
      .def("outstanding", &LaunchQueue::outstanding)
      .def("launch", &LaunchQueue::launch, py::arg("native"), py::arg("plan"), py::arg("x"), py::arg("router_weight"),
           py::arg("w1"), py::arg("w2"), py::arg("saved_pre"), py::arg("thread"))
      .def_static("launchable", &LaunchQueue::launchable, py::arg("native"), py::arg("x"),
                  "Whether x's device is the current one and its current stream captures no graph")
      .def("retire_finished", &LaunchQueue::retire_finished,
           "Retire finished clean launches, oldest first; True when one that finished has an error")
      .def("take", &LaunchQueue::take)
      .def("take_retired_last", &LaunchQueue::take_retired_last, py::arg("thread"))
      .def("forget_thread", &LaunchQueue::forget_thread, py::arg("thread"));
}
