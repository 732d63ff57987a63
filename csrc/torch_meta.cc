// torch_meta.cc — reads the metadata of many PyTorch tensors in one call (dtype, shape, data
// address, contiguity), for mlfabric.torch's grouped calls. Through torch's Python API each read
// costs 0.1-0.2 us, ~0.8 us a tensor in all: a grouped allreduce of 100 small tensors spent more
// on reading them than on moving them. Here they come from the C functions of PyTorch's stable
// AOTInductor shim (aoti_torch_*, a C ABI kept stable across releases), looked up at run time in
// the libtorch_cpu that `import torch` already loaded: mlfabric still builds without PyTorch, and
// a torch without the shim simply leaves the Python path in charge (mlfabric/torch/tensor_meta.py).
//
// The handles come from torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors (one new at::Tensor
// reference per tensor, in capsules); scan() deletes every one of them, whatever happens.
#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace mlf {
namespace {

using Handle = void*;  // AtenTensorHandle: an at::Tensor* owned by the caller
using Err = int32_t;   // AOTITorchError: 0 is success

struct Shim {
  Err (*device_type)(Handle, int32_t*) = nullptr;
  Err (*layout)(Handle, int32_t*) = nullptr;
  Err (*dtype)(Handle, int32_t*) = nullptr;
  Err (*dim)(Handle, int64_t*) = nullptr;
  Err (*sizes)(Handle, int64_t**) = nullptr;
  Err (*data_ptr)(Handle, void**) = nullptr;
  Err (*is_contiguous)(Handle, bool*) = nullptr;
  Err (*destroy)(Handle) = nullptr;
  int32_t cpu = 0, strided = 0;
  std::vector<int> code_of;  // torch's ScalarType value -> mlfabric's dtype code (-1: none)
  bool ready = false;
};

Shim shim;

template <typename F>
bool find(void* lib, const char* name, F*& fn) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  return fn != nullptr;
}

bool constant(void* lib, const std::string& name, int32_t* value) {
  int32_t (*fn)() = nullptr;
  if (!find(lib, name.c_str(), fn)) return false;
  *value = fn();
  return true;
}

// Opens the shim in the already loaded library at `path` (RTLD_NOLOAD: never loads a second
// copy). dtypes: the names of mlfabric's dtype codes, in code order (aoti_torch_dtype_<name>).
bool open(const std::string& path, const std::vector<std::string>& dtypes) {
  Shim s;
  void* lib = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  bool ok = find(lib, "aoti_torch_get_device_type", s.device_type) &&
            find(lib, "aoti_torch_get_layout", s.layout) &&
            find(lib, "aoti_torch_get_dtype", s.dtype) && find(lib, "aoti_torch_get_dim", s.dim) &&
            find(lib, "aoti_torch_get_sizes", s.sizes) &&
            find(lib, "aoti_torch_get_data_ptr", s.data_ptr) &&
            find(lib, "aoti_torch_is_contiguous", s.is_contiguous) &&
            find(lib, "aoti_torch_delete_tensor_object", s.destroy) &&
            constant(lib, "aoti_torch_device_type_cpu", &s.cpu) &&
            constant(lib, "aoti_torch_layout_strided", &s.strided);
  for (size_t code = 0; ok && code < dtypes.size(); ++code) {
    int32_t raw = -1;
    ok = constant(lib, "aoti_torch_dtype_" + dtypes[code], &raw) && raw >= 0 && raw < 1024;
    if (ok) {
      if (static_cast<size_t>(raw) >= s.code_of.size()) s.code_of.resize(raw + 1, -1);
      s.code_of[raw] = static_cast<int>(code);
    }
  }
  dlclose(lib);  // NOLOAD took a reference; torch keeps the library loaded
  s.ready = ok;
  if (ok) shim = s;
  return ok;
}

// Deletes every handle in the list when it goes out of scope.
struct Handles {
  std::vector<Handle> h;
  ~Handles() {
    for (Handle x : h)
      if (x != nullptr) shim.destroy(x);
  }
};

// (signature, addresses) of the tensors behind `capsules`, or None where one is not a dense CPU
// tensor of a dtype mlfabric moves (the caller's Python checks then name it). signature: bytes,
// int64 words [dtype code, ndim, dims...] per tensor, which the caller compares, hashes and
// decodes (tensor_meta.py); addresses: a uint64 array of their data pointers, or None when one
// is not contiguous.
py::object scan(const py::list& capsules) {
  Handles handles;
  const Py_ssize_t n = PyList_GET_SIZE(capsules.ptr());
  handles.h.reserve(n);
  bool all_capsules = true;
  for (Py_ssize_t i = 0; i < n; ++i) {  // every handle first: each one is deleted
    PyObject* c = PyList_GET_ITEM(capsules.ptr(), i);
    Handle h = PyCapsule_CheckExact(c) ? PyCapsule_GetPointer(c, nullptr) : nullptr;
    if (h == nullptr) {
      PyErr_Clear();
      all_capsules = false;
    }
    handles.h.push_back(h);
  }
  if (!all_capsules) throw py::type_error("torch_scan: expected the capsules of tensor handles");
  if (!shim.ready) return py::none();
  std::vector<int64_t> words;
  words.reserve(3 * n);
  py::array_t<uint64_t> ptrs(n);
  uint64_t* out = ptrs.mutable_data();
  bool all_contiguous = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Handle t = handles.h[i];
    int32_t device = -1, layout = -1, dtype = -1;
    int64_t dim = 0;
    int64_t* sizes = nullptr;
    void* data = nullptr;
    bool contiguous = false;
    if (shim.device_type(t, &device) || device != shim.cpu || shim.layout(t, &layout) ||
        layout != shim.strided || shim.dtype(t, &dtype) || dtype < 0 ||
        static_cast<size_t>(dtype) >= shim.code_of.size() || shim.code_of[dtype] < 0 ||
        shim.dim(t, &dim) || shim.sizes(t, &sizes) || shim.is_contiguous(t, &contiguous) ||
        shim.data_ptr(t, &data))
      return py::none();
    words.push_back(shim.code_of[dtype]);
    words.push_back(dim);
    words.insert(words.end(), sizes, sizes + dim);
    out[i] = reinterpret_cast<uint64_t>(data);
    all_contiguous = all_contiguous && contiguous;
  }
  py::bytes sig(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(int64_t));
  return py::make_tuple(sig, all_contiguous ? py::object(ptrs) : py::none());
}

}  // namespace

void bind_torch_meta(py::module_& m) {
  m.def("torch_shim_open", &open, py::arg("path"), py::arg("dtypes"),
        "Look up PyTorch's aoti_torch_* C functions in the loaded library at path; dtypes: the "
        "names of mlfabric's dtype codes in order. False (torch_scan unavailable) if any is "
        "missing.");
  m.def("torch_scan", &scan, py::arg("handles"),
        "(signature bytes: int64 [dtype code, ndim, dims...] per tensor; their data addresses, "
        "a uint64 array, or None if one is not contiguous) of the tensors behind "
        "torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors' handles, which it deletes; None "
        "if one is not a dense CPU tensor of an mlfabric dtype.");
}

}  // namespace mlf
