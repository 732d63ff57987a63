// bind_sched.cc — Python binding of the scheduler's fast path (sched_fast.h) as
// mlfabric._C.sched_run, and of the one-transfer sends of sched_send.cc (send_t_en, send_path,
// send_subtract).
// mlfabric/sched/fast.py hands over the network's links and the batch as plain Python lists;
// they are read into C++ structures with the GIL held, Alg. 2 and Alg. 3 run with the GIL
// released, and the results come back as flat lists that fast.py turns into the Python objects.
// Lists, not numpy arrays: at the small batch sizes the scheduler usually sees (|U| < 30), array
// conversions would cost more than the algorithms.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "sched_fast.h"

namespace py = pybind11;

namespace mlf {
namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw py::value_error("sched_run: " + what);
}

// A list of numbers (Python floats or ints) as doubles.
std::vector<double> doubles(PyObject* seq, const char* what) {
  check(PyList_Check(seq), std::string(what) + " must be a list");
  const Py_ssize_t n = PyList_GET_SIZE(seq);
  std::vector<double> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyList_GET_ITEM(seq, i);
    out[i] = PyFloat_Check(x) ? PyFloat_AS_DOUBLE(x) : PyFloat_AsDouble(x);
    if (out[i] == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  }
  return out;
}

std::vector<int> ints(PyObject* seq, const char* what) {
  check(PyList_Check(seq), std::string(what) + " must be a list");
  const Py_ssize_t n = PyList_GET_SIZE(seq);
  std::vector<int> out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const long x = PyLong_AsLong(PyList_GET_ITEM(seq, i));
    if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
    out[i] = static_cast<int>(x);
  }
  return out;
}

py::list to_list(const std::vector<double>& v) {
  PyObject* l = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (l == nullptr) throw py::error_already_set();
  for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(l, i, PyFloat_FromDouble(v[i]));
  return py::reinterpret_steal<py::list>(l);
}

template <class T>
py::list to_int_list(const std::vector<T>& v) {
  PyObject* l = PyList_New(static_cast<Py_ssize_t>(v.size()));
  if (l == nullptr) throw py::error_already_set();
  for (size_t i = 0; i < v.size(); ++i) PyList_SET_ITEM(l, i, PyLong_FromLongLong(v[i]));
  return py::reinterpret_steal<py::list>(l);
}

sched::Network make_network(int hosts, const py::list& link_t, const py::list& link_v,
                            const py::dict& core_paths) {
  const size_t n_links = link_t.size();
  check(hosts >= 1 && n_links >= 2u * hosts && link_v.size() == n_links,
        "links must hold every host's egress and ingress, times and values alike");
  std::vector<sched::Profile> links(n_links);
  for (size_t k = 0; k < n_links; ++k) {
    links[k].t = doubles(PyList_GET_ITEM(link_t.ptr(), k), "a link's times");
    links[k].v = doubles(PyList_GET_ITEM(link_v.ptr(), k), "a link's values");
    check(!links[k].t.empty() && links[k].t.size() == links[k].v.size() && links[k].t[0] == 0.0,
          "link " + std::to_string(k) + " must start at time 0 and have a value per time");
  }
  std::unordered_map<int64_t, std::vector<int>> core;
  for (auto item : core_paths) {  // (src, dst) -> link indices, as Network._core_paths
    const auto pair = py::reinterpret_borrow<py::tuple>(item.first);
    check(pair.size() == 2, "core paths are keyed by (src, dst)");
    const int src = pair[0].cast<int>(), dst = pair[1].cast<int>();
    check(src >= 0 && src < hosts && dst >= 0 && dst < hosts,
          "a core path joins hosts outside the network");
    std::vector<int> via;
    for (auto c : item.second) {
      via.push_back(c.cast<int>());
      check(via.back() >= 2 * hosts && via.back() < static_cast<int>(n_links),
            "core path names a non-core link");
    }
    core.emplace(static_cast<int64_t>(src) * hosts + dst, std::move(via));
  }
  return sched::Network(hosts, std::move(links), std::move(core));
}

void export_network(py::dict& out, const char* name, const sched::Network& nw) {
  py::list t(nw.links.size()), v(nw.links.size());
  for (size_t k = 0; k < nw.links.size(); ++k) {
    t[k] = to_list(nw.links[k].t);
    v[k] = to_list(nw.links[k].v);
  }
  out[(std::string(name) + "_t").c_str()] = t;
  out[(std::string(name) + "_v").c_str()] = v;
}

// A transfer table as (ends, offsets into segments, segments flat: t0, t1, rate, ...).
void export_table(py::dict& out, const char* name, const sched::TransferTable& tr) {
  static_assert(sizeof(sched::Seg) == 3 * sizeof(double), "Seg must be three packed doubles");
  const double* flat = reinterpret_cast<const double*>(tr.segs.data());
  out[(std::string(name) + "_end").c_str()] = to_list(tr.end);
  out[(std::string(name) + "_off").c_str()] = to_int_list(tr.off);
  out[(std::string(name) + "_segs").c_str()] =
      to_list(std::vector<double>(flat, flat + 3 * tr.segs.size()));
}

py::dict sched_run(int hosts, const py::list& link_t, const py::list& link_v,
                   const py::dict& core_paths, int server, double start, const py::list& worker,
                   const py::list& size, const py::list& send_at, const py::list& deadline,
                   const py::list& aggs, double agg_scale, bool cut_through, bool plain,
                   bool order_network) {
  sched::Network base = make_network(hosts, link_t, link_v, core_paths);
  sched::Batch b;
  b.server = server;
  b.start = start;
  b.worker = ints(worker.ptr(), "worker");
  b.size = doubles(size.ptr(), "size");
  b.send_at = doubles(send_at.ptr(), "send_at");
  b.deadline = doubles(deadline.ptr(), "deadline");
  b.aggs = ints(aggs.ptr(), "aggs");
  b.agg_scale = agg_scale;
  b.cut_through = cut_through;
  check(agg_scale >= 1.0, "agg_scale must be >= 1");
  const size_t n = b.worker.size();
  check(b.size.size() == n && b.send_at.size() == n && b.deadline.size() == n,
        "per-update lists differ in length");
  check(server >= 0 && server < hosts, "server is not a host");
  for (int w : b.worker) check(w >= 0 && w < hosts, "a worker is not a host");
  for (int a : b.aggs) check(a >= 0 && a < hosts && a != server, "bad aggregator");
  for (double s : b.send_at) check(s >= 0, "send times must be >= 0");

  const sched::Mode mode = plain ? sched::Mode::plain : sched::Mode::fast;
  sched::Ordering o;
  sched::Grouping g;
  double s_order = 0.0, s_aggregate = 0.0;  // for the benchmark's --profile
  {
    py::gil_scoped_release nogil;
    using clock = std::chrono::steady_clock;
    const auto t0 = clock::now();
    o = sched::order_updates(base, b, mode);
    const auto t1 = clock::now();
    g = sched::aggregate(base, b, o, mode);
    const auto t2 = clock::now();
    s_order = std::chrono::duration<double>(t1 - t0).count();
    s_aggregate = std::chrono::duration<double>(t2 - t1).count();
  }

  py::dict out;
  out["order"] = to_int_list(o.order);
  std::vector<int> drop_idx, drop_why;
  for (const auto& d : o.dropped) {
    drop_idx.push_back(d.first);
    drop_why.push_back(d.second);
  }
  out["drop_idx"] = to_int_list(drop_idx);
  out["drop_why"] = to_int_list(drop_why);
  export_table(out, "o", o.transfers);
  if (order_network) export_network(out, "o_net", o.network);
  out["n_direct"] = g.n_direct;
  out["makespan"] = g.makespan;
  out["cases"] = to_list(g.cases);
  out["agg_host"] = to_int_list(g.agg_host);
  out["agg_count"] = to_int_list(g.agg_count);
  export_table(out, "in", g.inbound);
  export_table(out, "at", g.agg_transfer);
  out["pipeline"] = g.pipeline;
  out["pipeline_chosen"] = g.pipeline_chosen;
  out["pipe_hosts"] = to_int_list(g.pipe_hosts);
  export_table(out, "pp", g.pipe);
  // The network after the plan stays in C++ until asked for (sched_network_lists): a caller
  // that never reads it (the simulator without a replica) never pays for ~2 lists per link.
  auto* after = new std::vector<sched::Profile>(std::move(g.network.links));
  out["g_net"] = py::capsule(after, [](void* p) {
    delete static_cast<std::vector<sched::Profile>*>(p);
  });
  out["seconds_order"] = s_order;
  out["seconds_aggregate"] = s_aggregate;
  return out;
}

}  // namespace

// sched_run's g_net: the links' (times, values) lists of the network after the plan.
py::tuple sched_network_lists(const py::capsule& links) {
  const auto* v = links.get_pointer<std::vector<sched::Profile>>();
  py::list t(v->size()), r(v->size());
  for (size_t k = 0; k < v->size(); ++k) {
    t[k] = to_list((*v)[k].t);
    r[k] = to_list((*v)[k].v);
  }
  return py::make_tuple(t, r);
}

void bind_sched_send(py::module_& m);  // sched_send.cc: t_en and NetUp on Profiles' lists

void bind_sched(py::module_& m) {
  bind_sched_send(m);
  m.def("sched_network_lists", &sched_network_lists, py::arg("g_net"),
        "The (times, values) lists of every link of sched_run's g_net (the network after the "
        "plan), built on request.");
  m.def("sched_run", &sched_run, py::arg("hosts"), py::arg("link_t"), py::arg("link_v"),
        py::arg("core_paths"), py::arg("server"), py::arg("start"), py::arg("worker"),
        py::arg("size"), py::arg("send_at"), py::arg("deadline"), py::arg("aggs"),
        py::arg("agg_scale"), py::arg("cut_through"), py::arg("plain"),
        py::arg("order_network"),
        "Alg. 2 then Alg. 3 of the MLfabric scheduler (see mlfabric/sched/fast.py): links as "
        "lists of times and of values, core_paths {(src, dst): [link, ...]}, the batch as "
        "per-update lists in ascending id order, aggs in group order, agg_scale as "
        "aggregation.aggregate's, cut_through as aggregation.aggregate's (the pipeline case "
        "included). Returns a dict of flat result lists. plain=True runs the "
        "paper's loops without the exact shortcuts; order_network=False skips exporting the "
        "network after ordering.");
}

}  // namespace mlf
