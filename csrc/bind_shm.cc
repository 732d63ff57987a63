// bind_shm.cc — Python binding of the shared-memory engine (mlfabric._C.ShmEngine). Arguments are
// converted while holding the GIL; the engine runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "shm_engine.h"

namespace py = pybind11;

namespace mlf {

void bind_shm(py::module_& m) {
  py::class_<ShmEngine>(m, "ShmEngine")
      .def(py::init<uintptr_t, size_t, int, int, size_t, int, double>(), py::arg("base"),
           py::arg("nbytes"), py::arg("rank"), py::arg("nranks"), py::arg("block_bytes"),
           py::arg("slots"), py::arg("timeout_s"))
      .def_static("required_bytes", &ShmEngine::required_bytes)
      .def("reset_segment", &ShmEngine::reset_segment)
      .def(
          "run",
          [](ShmEngine& self, int kind, int dtype, int op, double scale, int root, uintptr_t in,
             uintptr_t out, size_t count, std::vector<size_t> chunks, std::vector<int64_t> header,
             std::vector<uintptr_t> peer_in, std::vector<uintptr_t> peer_out) {
            CallArgs a;
            a.kind = static_cast<Kind>(kind);
            a.dtype = static_cast<DType>(dtype);
            a.op = static_cast<RedOp>(op);
            a.scale = scale;
            a.root = root;
            a.in = reinterpret_cast<const char*>(in);
            a.out = reinterpret_cast<char*>(out);
            a.count = count;
            a.chunks = std::move(chunks);
            a.header = std::move(header);
            a.peer_in = std::move(peer_in);
            a.peer_out = std::move(peer_out);
            CallResult r;
            {
              py::gil_scoped_release nogil;
              r = self.run(a);
            }
            return py::make_tuple(r.status, r.zero_copy, r.message);
          },
          "Run one collective; returns (status, zero_copy, message). status 0 ok, 1 header "
          "mismatch (see headers()), 2 timeout (the engine is unusable afterwards).")
      .def(
          "run_arrays",
          [](ShmEngine& self, int kind, int dtype, int op, double scale, const py::array& in,
             py::array& out, std::vector<int64_t> header) {
            // The small-call fast path: C-contiguous numpy arrays (checked by the caller), no
            // zero-copy candidacy, count = in.size.
            CallArgs a;
            a.kind = static_cast<Kind>(kind);
            a.dtype = static_cast<DType>(dtype);
            a.op = static_cast<RedOp>(op);
            a.scale = scale;
            a.in = static_cast<const char*>(in.data());
            a.out = static_cast<char*>(out.mutable_data());
            a.count = static_cast<size_t>(in.size());
            a.header = std::move(header);
            CallResult r;
            {
              py::gil_scoped_release nogil;
              r = self.run(a);
            }
            return py::make_tuple(r.status, r.zero_copy, r.message);
          },
          "run() for small calls on numpy arrays: pointers taken from the arrays themselves.")
      .def("headers", &ShmEngine::headers)
      .def_property_readonly("rounds", &ShmEngine::rounds)
      .def_property_readonly("broken", &ShmEngine::broken)
      .def("set_timeout", &ShmEngine::set_timeout);
}

}  // namespace mlf
