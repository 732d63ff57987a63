// sched_send.cc — the scheduler's network model (paper §5.1, Fig. 4b t_en and Fig. 4c NetUp)
// working directly on mlfabric.sched.network.Profile's Python lists, for callers that send one
// transfer at a time (the simulator executes ~2.6 transfers per update on its true network).
//
// mlfabric/sched/network.py stays the reference; these functions compute the same floats with
// the same operations in the same order (as csrc/sched_fast.cc does on its own copies), and they
// edit the lists in place exactly as Profile._split / subtract / _merge do, so a Profile cannot
// tell which code touched it. No copies: the walk reads the list items, NetUp inserts, rewrites
// and deletes items, so a send costs what the arithmetic costs, not a conversion of its links.
//
// Values are read as doubles: Profile's lists hold floats (Profile's constructor converts); an
// int item is read with PyFloat_AsDouble, which is exact below 2**53.
//
// Exposed (raw METH_FASTCALL functions; network.py wraps them and falls back to Python when this
// part is not built):
//   send_t_en(links, size, start)          -> (end, [t0, t1, rate, ...]) or (inf, None)
//   send_path(links, size, start, limit)   -> the same, reserved on every link (per link, per
//                                             segment, as Network.reserve) unless end > limit
//   send_subtract(t, v, t0, t1, rate)      -> None: Profile.subtract on the lists t and v
//   shuffle_seeded(list, seed)             -> a new list: random.Random(seed).shuffle's order
//                                             (aggregation.group_order, Alg. 3's random
//                                             pre-assignment; seed an int with |seed| < 2**64)
//   book_add(t, v, segments)               -> adds made, or -1 (nothing done: a segment starts
//                                             before 0): mlfabric.sched.view.Book.add per
//                                             segment, on the book's lists
//   view_residual(bt, bv, k, r)            -> (t, v): view.SchedulerView._build's lists
//   view_links(ids, caps, booked, cache, now, Profile) -> the Profiles of SchedulerView.network
//   book_t_en([(bt, bv, r), ...], now, size, start) -> t_en over SchedulerView.residuals
// (the simulator's scheduler view keeps its book of planned reservations as the same kind of
// piecewise-constant lists; these two are its per-transfer and per-batch hot loops.)
// shuffle_seeded is CPython's Mersenne Twister (Modules/_randommodule.c: init_by_array from the
// seed's 32-bit words, genrand_uint32) and random.py's shuffle (_randbelow_with_getrandbits): the
// same permutation without building a Random object and a Python loop per batch. scheduler.py
// checks it against the running Python's random at import and uses it only if they agree.
// `links` is a tuple or list of objects with list attributes t and v; start must be >= 0.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <Python.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace mlf {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kMaxLinks = 16;

struct Fail {};  // a Python error is set

inline double num(PyObject* x) {
  if (PyFloat_CheckExact(x)) return PyFloat_AS_DOUBLE(x);
  const double d = PyFloat_AsDouble(x);
  if (d == -1.0 && PyErr_Occurred()) throw Fail();
  return d;
}

inline double item(PyObject* list, Py_ssize_t i) { return num(PyList_GET_ITEM(list, i)); }

// bisect.bisect_right(a, x, lo): the same halving, the same comparisons (x < a[mid]).
Py_ssize_t bisect_right(PyObject* a, double x, Py_ssize_t lo = 0) {
  Py_ssize_t hi = PyList_GET_SIZE(a);
  while (lo < hi) {
    const Py_ssize_t mid = (lo + hi) / 2;
    if (x < item(a, mid)) hi = mid; else lo = mid + 1;
  }
  return lo;
}

struct Link {
  PyObject* t;  // borrowed (held by the Profile, which the caller holds)
  PyObject* v;
};

// The links of a path as (t, v) lists. Owned references are kept in `keep`.
int read_links(PyObject* links, Link* out, std::vector<PyObject*>& keep) {
  static PyObject* name_t = PyUnicode_InternFromString("t");
  static PyObject* name_v = PyUnicode_InternFromString("v");
  PyObject* seq = PySequence_Fast(links, "links must be a sequence of Profiles");
  if (seq == nullptr) throw Fail();
  keep.push_back(seq);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > kMaxLinks) {
    PyErr_Format(PyExc_ValueError, "a path of at most %d links, got %zd", kMaxLinks, n);
    throw Fail();
  }
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* p = PySequence_Fast_GET_ITEM(seq, j);
    PyObject* t = PyObject_GetAttr(p, name_t);
    if (t == nullptr) throw Fail();
    keep.push_back(t);
    PyObject* v = PyObject_GetAttr(p, name_v);
    if (v == nullptr) throw Fail();
    keep.push_back(v);
    if (!PyList_CheckExact(t) || !PyList_CheckExact(v) || PyList_GET_SIZE(t) == 0 ||
        PyList_GET_SIZE(t) != PyList_GET_SIZE(v)) {
      PyErr_SetString(PyExc_ValueError, "a Profile's t and v must be lists of equal length >= 1");
      throw Fail();
    }
    out[j] = {t, v};
  }
  return static_cast<int>(n);
}

struct Seg {
  double t0, t1, rate;
};

// network.t_en's loop, segment for segment.
double t_en(const Link* L, int n, double size, double start, std::vector<Seg>& segs) {
  if (size <= 0 || n == 0) return start;
  Py_ssize_t idx[kMaxLinks];
  for (int j = 0; j < n; ++j) idx[j] = bisect_right(L[j].t, start) - 1;
  double t = start, left = size;
  for (;;) {
    double rate = kInf, nxt = kInf;
    for (int j = 0; j < n; ++j) {
      const double r = item(L[j].v, idx[j]);
      if (r < rate) rate = r;
      if (idx[j] + 1 < PyList_GET_SIZE(L[j].t)) {
        const double x = item(L[j].t, idx[j] + 1);
        if (x < nxt) nxt = x;
      }
    }
    if (rate > 0) {
      if (nxt == kInf || rate * (nxt - t) >= left) {
        const double end = t + left / rate;
        segs.push_back({t, end, rate});
        return end;
      }
      segs.push_back({t, nxt, rate});
      left -= rate * (nxt - t);
    } else if (nxt == kInf) {
      return kInf;
    }
    t = nxt;
    for (int j = 0; j < n; ++j)
      if (idx[j] + 1 < PyList_GET_SIZE(L[j].t) && item(L[j].t, idx[j] + 1) == nxt) ++idx[j];
  }
}

// Profile._split: make x a breakpoint; return its index.
Py_ssize_t split(PyObject* t, PyObject* v, double x) {
  const Py_ssize_t k = bisect_right(t, x) - 1;
  if (item(t, k) == x) return k;
  PyObject* tx = PyFloat_FromDouble(x);
  if (tx == nullptr) throw Fail();
  const int bad = PyList_Insert(t, k + 1, tx);
  Py_DECREF(tx);
  if (bad || PyList_Insert(v, k + 1, PyList_GET_ITEM(v, k))) throw Fail();
  return k + 1;
}

// Profile.subtract then its _merge(a, b): the window lo-1..hi compacted in place.
void subtract(PyObject* t, PyObject* v, double t0, double t1, double rate) {
  if (!(t1 > t0) || rate == 0) return;
  const Py_ssize_t a = split(t, v, t0);
  const Py_ssize_t b = t1 < kInf ? split(t, v, t1) : PyList_GET_SIZE(t);
  for (Py_ssize_t k = a; k < b; ++k) {
    PyObject* x = PyFloat_FromDouble(item(v, k) - rate);
    if (x == nullptr) throw Fail();
    PyList_SetItem(v, k, x);  // steals x, releases the old value
  }
  const Py_ssize_t n = PyList_GET_SIZE(t);
  const Py_ssize_t lo = a > 1 ? a : 1;
  const Py_ssize_t hi = b < n - 1 ? b : n - 1;
  if (lo > hi) return;
  double last = item(v, lo - 1);
  Py_ssize_t w = lo;
  for (Py_ssize_t r = lo; r <= hi; ++r) {
    const double x = item(v, r);
    if (x != last) {
      if (w != r) {  // move items r -> w (the slot w holds one that is dropped)
        PyObject* tr = PyList_GET_ITEM(t, r);
        PyObject* vr = PyList_GET_ITEM(v, r);
        Py_INCREF(tr);
        Py_INCREF(vr);
        PyList_SetItem(t, w, tr);
        PyList_SetItem(v, w, vr);
      }
      ++w;
      last = x;
    }
  }
  if (w <= hi) {
    if (PyList_SetSlice(t, w, hi + 1, nullptr) || PyList_SetSlice(v, w, hi + 1, nullptr))
      throw Fail();
  }
}

PyObject* flat(const std::vector<Seg>& segs) {
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(3 * segs.size()));
  if (out == nullptr) throw Fail();
  Py_ssize_t i = 0;
  for (const Seg& s : segs) {
    for (double x : {s.t0, s.t1, s.rate}) {
      PyObject* f = PyFloat_FromDouble(x);
      if (f == nullptr) {
        Py_DECREF(out);
        throw Fail();
      }
      PyList_SET_ITEM(out, i++, f);
    }
  }
  return out;
}

bool args_ok(Py_ssize_t nargs, Py_ssize_t want, const char* name) {
  if (nargs == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, want, nargs);
  return false;
}

double arg_double(PyObject* x) { return num(x); }

// (end, flat segments) of a walk, reserving on every link when `limit` allows.
PyObject* walk(PyObject* const* args, bool reserve, double limit) {
  std::vector<PyObject*> keep;
  PyObject* result = nullptr;
  try {
    Link L[kMaxLinks];
    const int n = read_links(args[0], L, keep);
    const double size = arg_double(args[1]), start = arg_double(args[2]);
    if (!(start >= 0)) {
      PyErr_Format(PyExc_ValueError, "a transfer cannot start before time 0, got %R", args[2]);
      throw Fail();
    }
    thread_local std::vector<Seg> segs;
    segs.clear();
    const double end = t_en(L, n, size, start, segs);
    if (end == kInf || end > limit) {
      result = Py_BuildValue("(dO)", end, Py_None);
    } else {
      if (reserve)
        for (int j = 0; j < n; ++j)
          for (const Seg& s : segs) subtract(L[j].t, L[j].v, s.t0, s.t1, s.rate);
      PyObject* f = flat(segs);
      result = Py_BuildValue("(dN)", end, f);
    }
  } catch (const Fail&) {
    result = nullptr;
  }
  for (PyObject* o : keep) Py_DECREF(o);
  return result;
}

PyObject* py_t_en(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 3, "send_t_en")) return nullptr;
  return walk(args, false, kInf);
}

PyObject* py_send(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 4, "send_path")) return nullptr;
  try {
    return walk(args, true, arg_double(args[3]));
  } catch (const Fail&) {
    return nullptr;
  }
}

PyObject* py_subtract(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 5, "send_subtract")) return nullptr;
  try {
    PyObject *t = args[0], *v = args[1];
    if (!PyList_CheckExact(t) || !PyList_CheckExact(v) || PyList_GET_SIZE(t) == 0 ||
        PyList_GET_SIZE(t) != PyList_GET_SIZE(v)) {
      PyErr_SetString(PyExc_ValueError, "a Profile's t and v must be lists of equal length >= 1");
      return nullptr;
    }
    const double t0 = arg_double(args[2]), t1 = arg_double(args[3]), rate = arg_double(args[4]);
    if (t1 > t0 && rate != 0 && !(t0 >= 0)) {  // Python would split at index -1: not ours
      PyErr_Format(PyExc_ValueError, "cannot subtract before time 0, got %R", args[2]);
      return nullptr;
    }
    subtract(t, v, t0, t1, rate);
  } catch (const Fail&) {
    return nullptr;
  }
  Py_RETURN_NONE;
}

// --- the simulator's book of planned reservations (mlfabric/sched/view.py) --------------------

// Book.add(t0, t1, rate) on the lists t, v.
void book_add_one(PyObject* t, PyObject* v, double t0, double t1, double rate) {
  if (!(t1 > t0) || rate == 0) return;
  Py_ssize_t a = bisect_right(t, t0) - 1;
  if (item(t, a) != t0) {
    ++a;
    PyObject* x = PyFloat_FromDouble(t0);
    if (x == nullptr) throw Fail();
    const int bad = PyList_Insert(t, a, x);
    Py_DECREF(x);
    if (bad || PyList_Insert(v, a, PyList_GET_ITEM(v, a - 1))) throw Fail();
  }
  Py_ssize_t b;
  if (t1 < kInf) {
    b = bisect_right(t, t1, a) - 1;
    if (item(t, b) != t1) {
      ++b;
      PyObject* x = PyFloat_FromDouble(t1);
      if (x == nullptr) throw Fail();
      const int bad = PyList_Insert(t, b, x);
      Py_DECREF(x);
      if (bad || PyList_Insert(v, b, PyList_GET_ITEM(v, b - 1))) throw Fail();
    }
  } else {
    b = PyList_GET_SIZE(t);
  }
  for (Py_ssize_t k = a; k < b; ++k) {
    PyObject* x = PyFloat_FromDouble(item(v, k) + rate);
    if (x == nullptr) throw Fail();
    PyList_SetItem(v, k, x);
  }
  // only the two ends can have become equal to their outer neighbour
  if (b < PyList_GET_SIZE(v) && item(v, b) == item(v, b - 1)) {
    if (PyList_SetSlice(t, b, b + 1, nullptr) || PyList_SetSlice(v, b, b + 1, nullptr))
      throw Fail();
  }
  if (a > 0 && item(v, a) == item(v, a - 1)) {
    if (PyList_SetSlice(t, a, a + 1, nullptr) || PyList_SetSlice(v, a, a + 1, nullptr))
      throw Fail();
  }
}

PyObject* py_book_add(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 3, "book_add")) return nullptr;
  static PyObject* name_t0 = PyUnicode_InternFromString("t0");
  static PyObject* name_t1 = PyUnicode_InternFromString("t1");
  static PyObject* name_rate = PyUnicode_InternFromString("rate");
  PyObject *t = args[0], *v = args[1];
  if (!PyList_CheckExact(t) || !PyList_CheckExact(v) || PyList_GET_SIZE(t) == 0 ||
      PyList_GET_SIZE(t) != PyList_GET_SIZE(v)) {
    PyErr_SetString(PyExc_ValueError, "a book's t and v must be lists of equal length >= 1");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(args[2], "segments must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  thread_local std::vector<Seg> segs;
  segs.clear();
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* s = PySequence_Fast_GET_ITEM(seq, i);
      double x[3];
      PyObject* names[3] = {name_t0, name_t1, name_rate};
      for (int f = 0; f < 3; ++f) {
        PyObject* o = PyObject_GetAttr(s, names[f]);
        if (o == nullptr) throw Fail();
        x[f] = PyFloat_CheckExact(o) ? PyFloat_AS_DOUBLE(o) : PyFloat_AsDouble(o);
        Py_DECREF(o);
        if (x[f] == -1.0 && PyErr_Occurred()) throw Fail();
      }
      segs.push_back({x[0], x[1], x[2]});
    }
    Py_DECREF(seq);
    seq = nullptr;
    for (const Seg& s : segs)  // Python would index from the end: leave such books to it
      if (s.t1 > s.t0 && s.rate != 0 && !(s.t0 >= 0)) return PyLong_FromLong(-1);
    for (const Seg& s : segs) book_add_one(t, v, s.t0, s.t1, s.rate);
  } catch (const Fail&) {
    Py_XDECREF(seq);
    return nullptr;
  }
  return PyLong_FromSsize_t(n);
}

// SchedulerView._build's lists: r - booked (clipped at 0) from book entry k on, from time 0,
// equal neighbours merged. New references in *t_out, *v_out.
void residual_lists(PyObject* bt, PyObject* bv, Py_ssize_t k, double r, PyObject** t_out,
                    PyObject** v_out) {
  PyObject* t = PyList_New(0);
  PyObject* v = PyList_New(0);
  try {
    if (t == nullptr || v == nullptr) throw Fail();
    const Py_ssize_t n = PyList_GET_SIZE(bt);
    double x = item(bv, k);
    double last = r > x ? r - x : 0.0;
    auto push = [](PyObject* list, PyObject* o) {  // steals o
      if (o == nullptr) throw Fail();
      const int bad = PyList_Append(list, o);
      Py_DECREF(o);
      if (bad) throw Fail();
    };
    push(t, PyFloat_FromDouble(0.0));
    push(v, PyFloat_FromDouble(last));
    for (Py_ssize_t j = k + 1; j < n; ++j) {
      x = item(bv, j);
      x = r > x ? r - x : 0.0;
      if (x != last) {
        if (PyList_Append(t, PyList_GET_ITEM(bt, j))) throw Fail();
        push(v, PyFloat_FromDouble(x));
        last = x;
      }
    }
  } catch (const Fail&) {
    Py_XDECREF(t);
    Py_XDECREF(v);
    throw;
  }
  *t_out = t;
  *v_out = v;
}

bool book_lists(PyObject* bt, PyObject* bv) {
  if (PyList_CheckExact(bt) && PyList_CheckExact(bv) && PyList_GET_SIZE(bt) > 0 &&
      PyList_GET_SIZE(bt) == PyList_GET_SIZE(bv))
    return true;
  PyErr_SetString(PyExc_ValueError, "a book's t and v must be lists of equal length >= 1");
  return false;
}

PyObject* py_view_residual(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 4, "view_residual")) return nullptr;
  PyObject *bt = args[0], *bv = args[1];
  if (!book_lists(bt, bv)) return nullptr;
  PyObject *t, *v;
  try {
    const Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    if (k == -1 && PyErr_Occurred()) throw Fail();
    if (k < 0 || k >= PyList_GET_SIZE(bt)) {
      PyErr_SetString(PyExc_IndexError, "view_residual: book entry out of range");
      throw Fail();
    }
    residual_lists(bt, bv, k, num(args[3]), &t, &v);
  } catch (const Fail&) {
    return nullptr;
  }
  return Py_BuildValue("(NN)", t, v);
}

// SchedulerView.network's loop: for each link id, the cached view Profile when its book's
// version, its book entry at `now` and its report are those cached, else a new Profile of
// residual_lists, cached as (version, k, report, Profile). Returns the list of Profiles.
PyObject* py_view_links(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 6, "view_links")) return nullptr;
  static PyObject* name_t = PyUnicode_InternFromString("t");
  static PyObject* name_v = PyUnicode_InternFromString("v");
  static PyObject* name_version = PyUnicode_InternFromString("version");
  static PyObject* empty = PyTuple_New(0);
  PyObject *ids = args[0], *caps = args[1], *booked = args[2], *cache = args[3];
  PyObject* ptype = args[5];
  if (!PyList_CheckExact(ids) || !PyList_CheckExact(caps) || !PyList_CheckExact(booked) ||
      !PyList_CheckExact(cache) || !PyType_Check(ptype)) {
    PyErr_SetString(PyExc_TypeError, "view_links(ids, caps, booked, cache, now, Profile)");
    return nullptr;
  }
  const Py_ssize_t n_links = PyList_GET_SIZE(booked);
  if (PyList_GET_SIZE(caps) != n_links || PyList_GET_SIZE(cache) != n_links) {
    PyErr_SetString(PyExc_ValueError, "view_links: caps, booked and cache differ in length");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(ids);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  PyObject *bt = nullptr, *bv = nullptr, *ver = nullptr;
  try {
    const double now = num(args[4]);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const Py_ssize_t link = PyLong_AsSsize_t(PyList_GET_ITEM(ids, i));
      if (link == -1 && PyErr_Occurred()) throw Fail();
      if (link < 0 || link >= n_links) {
        PyErr_SetString(PyExc_IndexError, "view_links: link out of range");
        throw Fail();
      }
      PyObject* r_obj = PyList_GET_ITEM(caps, link);
      const double r = num(r_obj);
      PyObject* b = PyList_GET_ITEM(booked, link);
      bt = PyObject_GetAttr(b, name_t);
      if (bt == nullptr) throw Fail();
      bv = PyObject_GetAttr(b, name_v);
      if (bv == nullptr) throw Fail();
      ver = PyObject_GetAttr(b, name_version);
      if (ver == nullptr) throw Fail();
      if (!book_lists(bt, bv)) throw Fail();
      const Py_ssize_t k = bisect_right(bt, now) - 1;
      if (k < 0) {
        PyErr_SetString(PyExc_ValueError, "view_links: a book must start at time 0 <= now");
        throw Fail();
      }
      PyObject* got = PyList_GET_ITEM(cache, link);
      PyObject* hit = nullptr;
      if (PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 4) {
        const int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(got, 0), ver, Py_EQ);
        if (same < 0) throw Fail();
        if (same) {
          const Py_ssize_t gk = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1));
          if (gk == -1 && PyErr_Occurred()) throw Fail();
          if (gk == k && num(PyTuple_GET_ITEM(got, 2)) == r) hit = PyTuple_GET_ITEM(got, 3);
        }
      }
      if (hit != nullptr) {
        Py_INCREF(hit);
        PyList_SET_ITEM(out, i, hit);
      } else {
        PyObject *t, *v;
        residual_lists(bt, bv, k, r, &t, &v);
        PyObject* p = reinterpret_cast<PyTypeObject*>(ptype)->tp_new(
            reinterpret_cast<PyTypeObject*>(ptype), empty, nullptr);
        const bool ok = p != nullptr && PyObject_SetAttr(p, name_t, t) == 0 &&
                        PyObject_SetAttr(p, name_v, v) == 0;
        Py_DECREF(t);
        Py_DECREF(v);
        if (!ok) {
          Py_XDECREF(p);
          throw Fail();
        }
        PyObject* entry = Py_BuildValue("(OnOO)", ver, k, r_obj, p);
        if (entry == nullptr) {
          Py_DECREF(p);
          throw Fail();
        }
        PyList_SetItem(cache, link, entry);  // steals entry, releases the old one
        PyList_SET_ITEM(out, i, p);
      }
      Py_CLEAR(bt);
      Py_CLEAR(bv);
      Py_CLEAR(ver);
    }
  } catch (const Fail&) {
    Py_XDECREF(bt);
    Py_XDECREF(bv);
    Py_XDECREF(ver);
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

// view.SchedulerView.residuals(links, now) then network.t_en(those, size, start), without
// building the residual lists in Python: per link (bt, bv, r) the residual is
// t = [0.0] + bt[k+1:], v = [r - x if r > x else 0.0 for x in bv[k:]], k = bisect_right(bt, now)-1
// (equal neighbours not merged, as residuals() leaves them), and the walk is t_en's.
PyObject* py_book_t_en(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 4, "book_t_en")) return nullptr;
  try {
    PyObject* seq = PySequence_Fast(args[0], "links must be a sequence of (t, v, r)");
    if (seq == nullptr) throw Fail();
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    thread_local std::vector<std::vector<double>> ts, vs;
    if (ts.size() < static_cast<size_t>(n)) {
      ts.resize(n);
      vs.resize(n);
    }
    double now, size, start;
    try {
      if (n > kMaxLinks) {
        PyErr_SetString(PyExc_ValueError, "book_t_en: too many links");
        throw Fail();
      }
      now = num(args[1]);
      size = num(args[2]);
      start = num(args[3]);
      for (Py_ssize_t j = 0; j < n; ++j) {
        PyObject* e = PySequence_Fast_GET_ITEM(seq, j);
        if (!PyTuple_CheckExact(e) || PyTuple_GET_SIZE(e) != 3) {
          PyErr_SetString(PyExc_TypeError, "book_t_en: links are (t, v, r) tuples");
          throw Fail();
        }
        PyObject *bt = PyTuple_GET_ITEM(e, 0), *bv = PyTuple_GET_ITEM(e, 1);
        if (!book_lists(bt, bv)) throw Fail();
        const double r = num(PyTuple_GET_ITEM(e, 2));
        const Py_ssize_t k = bisect_right(bt, now) - 1;
        if (k < 0) {
          PyErr_SetString(PyExc_ValueError, "book_t_en: a book must start at time 0 <= now");
          throw Fail();
        }
        auto& t = ts[j];
        auto& v = vs[j];
        t.clear();
        v.clear();
        t.push_back(0.0);
        for (Py_ssize_t i = k + 1; i < PyList_GET_SIZE(bt); ++i) t.push_back(item(bt, i));
        for (Py_ssize_t i = k; i < PyList_GET_SIZE(bv); ++i) {
          const double x = item(bv, i);
          v.push_back(r > x ? r - x : 0.0);
        }
      }
    } catch (const Fail&) {
      Py_DECREF(seq);
      throw;
    }
    Py_DECREF(seq);
    thread_local std::vector<Seg> segs;
    segs.clear();
    double end = start;
    if (!(size <= 0 || n == 0)) {  // network.t_en's walk on the vectors
      if (!(start >= 0)) {
        PyErr_SetString(PyExc_ValueError, "book_t_en: start must be >= 0");
        throw Fail();
      }
      Py_ssize_t idx[kMaxLinks];
      for (Py_ssize_t j = 0; j < n; ++j)
        idx[j] = std::upper_bound(ts[j].begin(), ts[j].end(), start) - ts[j].begin() - 1;
      double t = start, left = size;
      for (;;) {
        double rate = kInf, nxt = kInf;
        for (Py_ssize_t j = 0; j < n; ++j) {
          if (vs[j][idx[j]] < rate) rate = vs[j][idx[j]];
          if (idx[j] + 1 < static_cast<Py_ssize_t>(ts[j].size()) && ts[j][idx[j] + 1] < nxt)
            nxt = ts[j][idx[j] + 1];
        }
        if (rate > 0) {
          if (nxt == kInf || rate * (nxt - t) >= left) {
            end = t + left / rate;
            segs.push_back({t, end, rate});
            break;
          }
          segs.push_back({t, nxt, rate});
          left -= rate * (nxt - t);
        } else if (nxt == kInf) {
          return Py_BuildValue("(dO)", kInf, Py_None);
        }
        t = nxt;
        for (Py_ssize_t j = 0; j < n; ++j)
          if (idx[j] + 1 < static_cast<Py_ssize_t>(ts[j].size()) && ts[j][idx[j] + 1] == nxt)
            ++idx[j];
      }
    }
    return Py_BuildValue("(dN)", end, flat(segs));
  } catch (const Fail&) {
    return nullptr;
  }
}

// --- random.Random(seed).shuffle ----------------------------------------------------------------

// CPython's MT19937 seeded with init_by_array. Two savings that leave every output the same:
// init_genrand(19650218)'s state is computed once (it does not depend on the seed), and the
// twist is done lazily: the first N - M outputs of a twist read only words it has not rewritten
// yet, so word kk is twisted when output kk is drawn (a shuffle of k aggregators draws ~k).
class MT {
 public:
  explicit MT(unsigned long long seed) {
    uint32_t key[2] = {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
    init_by_array(key, (seed >> 32) ? 2 : 1);
  }
  uint32_t next() {  // genrand_uint32
    if (index_ >= N - M) {  // past the lazy part: finish the twist the ordinary way
      if (index_ >= N) full_twist();
      else if (lazy_) finish_twist();
    } else if (lazy_) {
      twist_word(index_);
    }
    uint32_t y = mt_[index_++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680U;
    y ^= (y << 15) & 0xefc60000U;
    y ^= (y >> 18);
    return y;
  }
  uint32_t getrandbits(int k) { return k == 0 ? 0 : next() >> (32 - k); }  // 1 <= k <= 32

 private:
  static constexpr int N = 624, M = 397;
  uint32_t mt_[N];
  int index_ = N;
  bool lazy_ = false;  // in a twist whose words from index_ on are not twisted yet

  static const uint32_t* genrand_19650218() {
    static uint32_t state[N];
    static const bool done = [] {
      state[0] = 19650218U;
      for (int i = 1; i < N; ++i) state[i] = 1812433253U * (state[i - 1] ^ (state[i - 1] >> 30)) + i;
      return true;
    }();
    (void)done;
    return state;
  }
  void init_by_array(const uint32_t* key, int len) {
    std::memcpy(mt_, genrand_19650218(), sizeof(mt_));  // init_genrand(19650218U)
    int i = 1, j = 0;
    for (int k = N > len ? N : len; k; --k) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525U)) + key[j] + j;
      ++i;
      ++j;
      if (i >= N) {
        mt_[0] = mt_[N - 1];
        i = 1;
      }
      if (j >= len) j = 0;
    }
    for (int k = N - 1; k; --k) {
      mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941U)) - i;
      ++i;
      if (i >= N) {
        mt_[0] = mt_[N - 1];
        i = 1;
      }
    }
    mt_[0] = 0x80000000U;
    index_ = 0;  // the first draw twists: start lazily
    lazy_ = true;
    done_ = 0;
  }
  int done_ = 0;  // words twisted so far in a lazy twist
  void twist_word(int kk) {  // kk < N - M, words kk+1 and kk+M still untwisted
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    const uint32_t y = (mt_[kk] & 0x80000000U) | (mt_[kk + 1] & 0x7fffffffU);
    mt_[kk] = mt_[kk + M] ^ (y >> 1) ^ mag01[y & 0x1U];
    done_ = kk + 1;
  }
  void finish_twist() {
    for (int kk = done_; kk < N - M; ++kk) twist_word(kk);
    rest_of_twist();
    lazy_ = false;
  }
  void rest_of_twist() {
    static const uint32_t mag01[2] = {0x0U, 0x9908b0dfU};
    uint32_t y;
    int kk = N - M;
    for (; kk < N - 1; ++kk) {
      y = (mt_[kk] & 0x80000000U) | (mt_[kk + 1] & 0x7fffffffU);
      mt_[kk] = mt_[kk + (M - N)] ^ (y >> 1) ^ mag01[y & 0x1U];
    }
    y = (mt_[N - 1] & 0x80000000U) | (mt_[0] & 0x7fffffffU);
    mt_[N - 1] = mt_[M - 1] ^ (y >> 1) ^ mag01[y & 0x1U];
  }
  void full_twist() {
    for (int kk = 0; kk < N - M; ++kk) twist_word(kk);
    rest_of_twist();
    index_ = 0;
    lazy_ = false;
  }
};

int bit_length(unsigned long n) {
  int k = 0;
  while (n) {
    ++k;
    n >>= 1;
  }
  return k;
}

PyObject* py_shuffle(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!args_ok(nargs, 2, "shuffle_seeded")) return nullptr;
  if (!PyLong_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "shuffle_seeded: seed must be an int");
    return nullptr;
  }
  const unsigned long long seed = PyLong_AsUnsignedLongLong(args[1]);  // |seed|: the caller's
  if (seed == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
  PyObject* x = PySequence_List(args[0]);
  if (x == nullptr) return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(x);
  if (n > 0xffffffffLL) {
    Py_DECREF(x);
    PyErr_SetString(PyExc_ValueError, "shuffle_seeded: too many items");
    return nullptr;
  }
  if (n < 2) return x;
  MT mt(seed);
  for (Py_ssize_t i = n - 1; i >= 1; --i) {  // for i in reversed(range(1, len(x)))
    const unsigned long below = static_cast<unsigned long>(i + 1);
    const int k = bit_length(below);
    unsigned long r = mt.getrandbits(k);
    while (r >= below) r = mt.getrandbits(k);
    PyObject* a = PyList_GET_ITEM(x, i);
    PyList_SET_ITEM(x, i, PyList_GET_ITEM(x, r));
    PyList_SET_ITEM(x, r, a);
  }
  return x;
}

PyMethodDef kMethods[] = {
    {"send_t_en", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_t_en)),
     METH_FASTCALL,
     "send_t_en(links, size, start) -> (end, [t0, t1, rate, ...]) or (inf, None): "
     "mlfabric.sched.network.t_en on Profiles' lists (start >= 0)."},
    {"send_path", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_send)),
     METH_FASTCALL,
     "send_path(links, size, start, limit) -> (end, flat segments), reserved on every link "
     "(Profile.subtract per link, per segment); (end, None) and nothing reserved when "
     "end > limit or end is inf."},
    {"send_subtract", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_subtract)),
     METH_FASTCALL, "send_subtract(t, v, t0, t1, rate): Profile.subtract on the lists t, v."},
    {"book_add", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_book_add)),
     METH_FASTCALL,
     "book_add(t, v, segments) -> adds made, or -1 with nothing done (a segment before time "
     "0): mlfabric.sched.view.Book.add per segment on the lists t, v."},
    {"view_residual", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_view_residual)),
     METH_FASTCALL,
     "view_residual(bt, bv, k, r) -> (t, v): mlfabric.sched.view.SchedulerView._build's lists."},
    {"view_links", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_view_links)),
     METH_FASTCALL,
     "view_links(ids, caps, booked, cache, now, Profile) -> [Profile]: "
     "mlfabric.sched.view.SchedulerView.network's per-link loop (cache check, rebuild)."},
    {"book_t_en", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_book_t_en)),
     METH_FASTCALL,
     "book_t_en([(bt, bv, r), ...], now, size, start) -> (end, flat segments) or (inf, None): "
     "network.t_en over mlfabric.sched.view.SchedulerView.residuals(...) of those books."},
    {"shuffle_seeded", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_shuffle)),
     METH_FASTCALL,
     "shuffle_seeded(items, seed) -> list: random.Random(seed).shuffle's order of items, "
     "for an int seed with 0 <= seed < 2**64 (pass abs(seed))."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void bind_sched_send(pybind11::module_& m) {
  for (PyMethodDef* d = kMethods; d->ml_name != nullptr; ++d) {
    PyObject* f = PyCFunction_NewEx(d, nullptr, m.attr("__name__").ptr());
    if (f == nullptr) throw pybind11::error_already_set();
    m.attr(d->ml_name) = pybind11::reinterpret_steal<pybind11::object>(f);
  }
}

}  // namespace mlf
