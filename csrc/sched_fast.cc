// sched_fast.cc — the scheduler's fast path: network model (Fig. 4), Alg. 2 and Alg. 3
// (paper §5.1, §5.2) computing exactly what mlfabric/sched/{network,ordering,aggregation}.py
// compute, cut-through aggregates and the pipeline case included. See sched_fast.h for the
// contract and docs/sched/fast.md for why each shortcut is exact.
//
// Bit-identical floats need the same operations in the same order as Python's: no fused
// multiply-add (x - a * b must round twice, as Python's does) and no reassociation. setup.py
// builds without -ffast-math; the pragmas below also keep contraction off whatever the flags.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "sched_fast.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>

namespace mlf {
namespace sched {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// bisect_right(t, x) - 1: the segment holding x (x >= 0 = t[0]).
inline int segment_of(const std::vector<double>& t, double x) {
  return static_cast<int>(std::upper_bound(t.begin(), t.end(), x) - t.begin()) - 1;
}

// Profile._split: make x a breakpoint; return its index.
int split(Profile& p, double x) {
  int k = segment_of(p.t, x);
  if (p.t[k] == x) return k;
  p.t.insert(p.t.begin() + k + 1, x);
  p.v.insert(p.v.begin() + k + 1, p.v[k]);
  return k + 1;
}

// Python's max(a, b): a unless b is greater.
inline double pymax(double a, double b) { return b > a ? b : a; }

}  // namespace

// --- network ------------------------------------------------------------------------------------

Network::Network(int hosts, std::vector<Profile> links_in,
                 std::unordered_map<int64_t, std::vector<int>> core_paths)
    : links(std::move(links_in)), hosts_(hosts), core_(std::move(core_paths)) {
  max_path_ = 2;
  for (const auto& kv : core_) max_path_ = std::max<int>(max_path_, 2 + kv.second.size());
  stamp_.assign(links.size(), 0);
}

int Network::path(int src, int dst, int* out) const {
  if (src == dst) return 0;
  int n = 0;
  out[n++] = src;
  if (!core_.empty()) {
    auto it = core_.find(static_cast<int64_t>(src) * hosts_ + dst);
    if (it != core_.end())
      for (int c : it->second) out[n++] = c;
  }
  out[n++] = hosts_ + dst;
  return n;
}

double Network::t_en(const int* path, int n, double size, double start, std::vector<Seg>* segs,
                     double cut, double cap) const {
  // (a cap alone is a path of one link to Python, so it is walked)
  if (size <= 0 || (n == 0 && cap == kNoCap)) return start;
  constexpr int kStack = 16;
  int idx_stack[kStack];
  const Profile* prof_stack[kStack];
  std::vector<int> idx_heap;
  std::vector<const Profile*> prof_heap;
  int* idx = idx_stack;
  const Profile** prof = prof_stack;
  if (n > kStack) {
    idx_heap.resize(n);
    prof_heap.resize(n);
    idx = idx_heap.data();
    prof = prof_heap.data();
  }
  for (int j = 0; j < n; ++j) {
    prof[j] = &links[path[j]];
    idx[j] = segment_of(prof[j]->t, start);
  }
  double t = start;
  double left = size;
  const bool cutting = cut < kInf;  // (a walk from +inf start must still run, as Python's does)
  if (cutting && t >= cut) return kInf;
  for (;;) {
    double rate = kInf;
    double nxt = kInf;
    for (int j = 0; j < n; ++j) {
      const Profile& p = *prof[j];
      const int i = idx[j];
      if (p.v[i] < rate) rate = p.v[i];
      if (i + 1 < static_cast<int>(p.t.size()) && p.t[i + 1] < nxt) nxt = p.t[i + 1];
    }
    if (cap < rate) rate = cap;  // the cap link, last, has no breakpoint after t = 0
    if (rate > 0) {
      if (nxt == kInf || rate * (nxt - t) >= left) {
        const double end = t + left / rate;
        if (segs) segs->push_back({t, end, rate});
        return end;
      }
      if (segs) segs->push_back({t, nxt, rate});
      left -= rate * (nxt - t);
    } else if (nxt == kInf) {
      return kInf;
    }
    t = nxt;
    // The end is never before t (left stays > 0, so end = t' + left/rate >= t' >= t).
    if (cutting && t >= cut) return kInf;
    for (int j = 0; j < n; ++j) {
      const Profile& p = *prof[j];
      if (idx[j] + 1 < static_cast<int>(p.t.size()) && p.t[idx[j] + 1] == nxt) ++idx[j];
    }
  }
}

double Network::t_en_relay(const int* path, int n, double size, double start, double inbound_end,
                           std::vector<Seg>* segs) const {
  const size_t mark = segs->size();
  double end = t_en(path, n, size, start, segs, kInf);
  if (end >= inbound_end || !(inbound_end > start)) return end;
  // it would get ahead of its inbound: again, at most at the inbound's pace
  segs->resize(mark);
  end = t_en(path, n, size, start, segs, kInf, size / (inbound_end - start));
  if (end < inbound_end && segs->size() > mark) {  // float rounding: an ulp early, as Python
    segs->back().t1 = inbound_end;
    end = inbound_end;
  }
  return end;
}

// Profile.subtract. The profile has no equal neighbours before, so after subtracting over
// [a, b) only pairs from a-1 to b can be equal: merging that window gives what Python's merge of
// the whole list gives.
void Network::subtract(Profile& p, double t0, double t1, double rate) {
  if (!(t1 > t0) || rate == 0) return;
  const int a = split(p, t0);
  const int b = t1 < kInf ? split(p, t1) : static_cast<int>(p.t.size());
  for (int k = a; k < b; ++k) p.v[k] = p.v[k] - rate;
  const int n = static_cast<int>(p.t.size());
  const int lo = a > 0 ? a - 1 : 0;
  const int hi = b < n ? b : n - 1;
  int w = lo + 1;
  for (int r = lo + 1; r <= hi; ++r) {
    if (p.v[r] != p.v[w - 1]) {
      p.t[w] = p.t[r];
      p.v[w] = p.v[r];
      ++w;
    }
  }
  if (w <= hi) {
    p.t.erase(p.t.begin() + w, p.t.begin() + hi + 1);
    p.v.erase(p.v.begin() + w, p.v.begin() + hi + 1);
  }
}

void Network::save(int k, Journal* j) {
  if (j == nullptr || stamp_[k] == epoch_) return;
  stamp_[k] = epoch_;
  if (j->used == j->saved.size()) j->saved.emplace_back();
  auto& slot = j->saved[j->used++];
  slot.first = k;
  slot.second = links[k];
}

void Network::reserve(const int* path, int n, const std::vector<Seg>& segs, Journal* j) {
  for (int i = 0; i < n; ++i) {
    const int k = path[i];
    save(k, j);
    for (const Seg& s : segs) subtract(links[k], s.t0, s.t1, s.rate);
  }
}

void Network::undo(Journal& j) {
  // swap, not copy: the slot keeps the modified vectors' capacity for the next save
  for (size_t i = 0; i < j.used; ++i) std::swap(links[j.saved[i].first], j.saved[i].second);
  j.used = 0;
  ++epoch_;
}

void Network::commit(Journal& j) {
  j.used = 0;
  ++epoch_;
}

void TransferTable::add(double e, const std::vector<Seg>& s) {
  end.push_back(e);
  segs.insert(segs.end(), s.begin(), s.end());
  off.push_back(static_cast<int64_t>(segs.size()));
}

// --- Alg. 2: ordering ---------------------------------------------------------------------------

namespace {

// Per-update paths to one destination, precomputed once.
struct Paths {
  int width = 0;
  std::vector<int> links, len;
  Paths(const Network& nw, const Batch& b, int dst) : width(nw.max_path()) {
    const size_t n = b.worker.size();
    links.resize(n * width);
    len.resize(n);
    for (size_t g = 0; g < n; ++g) len[g] = nw.path(b.worker[g], dst, &links[g * width]);
  }
  const int* of(int g) const { return &links[static_cast<size_t>(g) * width]; }
};

// The paper's loop (ordering.order_updates line by line): every pick computes t_en for every
// candidate; NetUp works on a copy of the network.
class PlainOrderer {
 public:
  PlainOrderer(const Network& base, const Batch& b) : b_(b), paths_(base, b, b.server) {
    out_.network = base;
  }

  Ordering run() {
    const int n = static_cast<int>(b_.worker.size());
    std::vector<int> remaining(n);
    for (int g = 0; g < n; ++g) remaining[g] = g;
    Network& nw = out_.network;
    std::vector<Seg> segs;
    while (!remaining.empty()) {
      const double pos = static_cast<double>(out_.order.size() + 1);
      size_t w = 0;
      for (int g : remaining) {
        if (b_.deadline[g] < pos)
          out_.dropped.emplace_back(g, kStale);
        else
          remaining[w++] = g;
      }
      remaining.resize(w);
      if (remaining.empty()) break;
      bool forced = false;
      double end = 0.0;
      const int cur = pick(nw, pos, remaining, &forced, &end);
      if (end == kInf && forced) {  // the due update can never arrive; others still may
        out_.dropped.emplace_back(cur, kNoPath);
        remaining.erase(std::find(remaining.begin(), remaining.end(), cur));
        continue;
      }
      if (end == kInf) {  // the shortest has no capacity, so none has
        for (int g : remaining) out_.dropped.emplace_back(g, kNoPath);
        break;
      }
      segs.clear();
      t_en(nw, cur, &segs);
      remaining.erase(std::find(remaining.begin(), remaining.end(), cur));  // rest
      Network after = nw;
      after.reserve(paths_.of(cur), paths_.len[cur], segs);
      std::vector<int> live;
      for (int g : remaining)
        if (b_.deadline[g] >= pos + 1) live.push_back(g);
      if (forced && !live.empty()) {
        bool f2 = false;
        double nxt_end = 0.0;
        pick(after, pos + 1, live, &f2, &nxt_end);
        if (end > nxt_end) {
          out_.dropped.emplace_back(cur, kLookahead);
          continue;
        }
      }
      nw = std::move(after);
      out_.order.push_back(cur);
      out_.transfers.add(end, segs);
    }
    return std::move(out_);
  }

 private:
  double t_en(const Network& nw, int g, std::vector<Seg>* segs) const {
    return nw.t_en(paths_.of(g), paths_.len[g], b_.size[g], b_.send_at[g], segs, kInf);
  }

  // ShrtDline(pos, cands): the due one (dl <= pos) that finishes first if any is due, else the
  // one that finishes first; ties to the lower id (cands ascend).
  int pick(const Network& nw, double pos, const std::vector<int>& cands, bool* forced,
           double* end) const {
    bool due = false;
    for (int g : cands) due = due || b_.deadline[g] <= pos;
    int best = -1;
    double best_end = kInf;
    for (int g : cands) {
      if (due && !(b_.deadline[g] <= pos)) continue;
      const double e = t_en(nw, g, nullptr);
      if (best < 0 || e < best_end) {
        best = g;
        best_end = e;
      }
    }
    *forced = due;
    *end = best_end;
    return best;
  }

  const Batch& b_;
  Paths paths_;
  Ordering out_;
};

// The same choices with less work (docs/sched/fast.md, "Alg. 2").
//
// Buckets. An update whose path is its worker's egress E then the server's ingress I, sent from
// s, walks I's zero stretch from s to Z (the first instant from s where I has capacity) without
// any arithmetic: its state at Z is (Z, all bytes left). When E changes for the last time at or
// before Z, E is the constant c = E's last value from Z on, so the walk from Z is the same
// computation for every update with the same (c, size, s): same end, to the bit. Such updates
// share a bucket and one t_en per pick (the bucket's lowest id stands for all, which is also
// the tie-break the reference applies). Z never moves back (reservations only lower capacity,
// and a zero stays zero), so an update stays bucketable until its own worker's egress changes,
// i.e. until an update of that worker is reserved; then that worker's updates wait, evaluated
// one by one, until Z passes E's new last change.
//
// Each walk also stops as soon as it cannot beat the best so far (the end is never earlier
// than any time the walk has reached). The look-ahead only asks whether any next candidate
// finishes before the forced pick; it reserves in place and undoes from a journal.
class FastOrderer {
 public:
  FastOrderer(const Network& base, const Batch& b)
      : b_(b), paths_(base, b, b.server), n_(static_cast<int>(b.worker.size())),
        ingress_(base.hosts() + b.server), state_(n_), bucket_of_(n_, -1), mark_(n_, 0),
        host_members_(base.hosts()), by_deadline_(n_) {
    out_.network = base;
    for (int g = 0; g < n_; ++g) {
      host_members_[b.worker[g]].push_back(g);
      // bucketable: egress + ingress only (no core links, not on the server's host), bytes > 0
      if (paths_.len[g] == 2 && b.size[g] > 0) {
        state_[g] = kWaiting;
        waiting_.push_back(g);
      } else {
        state_[g] = kSolo;
        solo_.push_back(g);
      }
      by_deadline_[g] = g;
    }
    std::stable_sort(by_deadline_.begin(), by_deadline_.end(),
                     [&](int x, int y) { return b.deadline[x] < b.deadline[y]; });
    remaining_ = n_;
  }

  Ordering run() {
    Network& nw = out_.network;
    std::vector<Seg> segs;
    while (remaining_ > 0) {
      const double pos = static_cast<double>(out_.order.size() + 1);
      drop_stale(pos);
      if (remaining_ == 0) break;

      // the updates due at pos (dl == pos: none is below pos any more), in id order
      due_.clear();
      for (size_t i = dl_lo_; i < by_deadline_.size() && deadline(i) <= pos; ++i)
        if (state_[by_deadline_[i]] != kGone) due_.push_back(by_deadline_[i]);
      Best best;
      if (!due_.empty()) {
        for (int g : due_) consider(nw, g, best);
      } else {
        refresh_waiting();
        for (size_t k = 0; k < buckets_.size(); ++k) {
          const int g = leader(static_cast<int>(k));
          if (g >= 0) consider(nw, g, best);
        }
        for (int g : waiting_) consider(nw, g, best);
        for (int g : solo_)
          if (state_[g] != kGone) consider(nw, g, best);
      }
      if (best.end == kInf && !due_.empty()) {  // the due update can never arrive
        out_.dropped.emplace_back(best.id, kNoPath);
        remove(best.id);
        continue;
      }
      if (best.end == kInf) {  // the shortest has no capacity, so none has
        for (int g = 0; g < n_; ++g)
          if (state_[g] != kGone) out_.dropped.emplace_back(g, kNoPath);
        break;
      }
      const int cur = best.id;
      const double end = best.end;
      segs.clear();
      t_en(nw, cur, &segs, kInf);

      // still live at pos + 1: every remaining update but those with dl < pos + 1 (cur among
      // them when forced)
      stale_next_.clear();
      size_t i = dl_lo_;
      for (; i < by_deadline_.size() && deadline(i) < pos + 1; ++i)
        if (state_[by_deadline_[i]] != kGone) stale_next_.push_back(by_deadline_[i]);
      const bool look = !due_.empty() &&
                        remaining_ - static_cast<int>(stale_next_.size()) > 0;
      nw.reserve(paths_.of(cur), paths_.len[cur], segs, look ? &journal_ : nullptr);
      if (look) {
        if (next_finishes_before(nw, pos + 1, i, cur, end)) {
          nw.undo(journal_);
          out_.dropped.emplace_back(cur, kLookahead);
          remove(cur);
          continue;
        }
        nw.commit(journal_);
      }
      out_.order.push_back(cur);
      out_.transfers.add(end, segs);
      remove(cur);
      egress_changed(b_.worker[cur]);
    }
    return std::move(out_);
  }

 private:
  enum State : uint8_t {
    kGone,      // applied or dropped
    kSolo,      // never bucketable: evaluated on its own at every pick
    kWaiting,   // bucketable once its worker's egress settles
    kBucketed,  // in bucket bucket_of_[g]
  };
  struct Bucket {
    std::vector<int> heap;  // member ids, min-heap; entries of members that left are skipped
    int live = 0;
  };
  struct Best {
    int id = -1;
    double end = kInf;
  };

  double deadline(size_t i) const { return b_.deadline[by_deadline_[i]]; }

  double t_en(const Network& nw, int g, std::vector<Seg>* segs, double cut) const {
    return nw.t_en(paths_.of(g), paths_.len[g], b_.size[g], b_.send_at[g], segs, cut);
  }

  // Keep the lexicographic least (end, id): what the reference's scan in id order with a strict
  // "<" finds. The walk stops once it cannot win: at best.end for a higher id, just past it for
  // a lower one.
  void consider(const Network& nw, int g, Best& best) const {
    double cut = kInf;
    if (best.id >= 0) cut = g < best.id ? std::nextafter(best.end, kInf) : best.end;
    const double e = t_en(nw, g, nullptr, cut);
    if (best.id < 0 || e < best.end || (e == best.end && g < best.id)) {
      best.id = g;
      best.end = e;
    }
  }

  void drop_stale(double pos) {
    stale_.clear();
    while (dl_lo_ < by_deadline_.size() && deadline(dl_lo_) < pos) {
      const int g = by_deadline_[dl_lo_++];
      if (state_[g] != kGone) stale_.push_back(g);
    }
    std::sort(stale_.begin(), stale_.end());  // the reference drops them in id order
    for (int g : stale_) {
      out_.dropped.emplace_back(g, kStale);
      remove(g);
    }
  }

  void remove(int g) {
    if (state_[g] == kBucketed) --buckets_[bucket_of_[g]].live;
    state_[g] = kGone;
    --remaining_;
  }

  // The walk from s reaches Z(s) with nothing sent; g's egress is settled when its last
  // change is at or before Z(s).
  bool settled(const Network& nw, int g) const {
    const Profile& in = nw.links[ingress_];
    const double s = b_.send_at[g];
    const int k = segment_of(in.t, s);
    double z = s;
    if (!(in.v[k] > 0)) z = k + 1 < static_cast<int>(in.t.size()) ? in.t[k + 1] : kInf;
    return nw.links[b_.worker[g]].t.back() <= z;
  }

  void refresh_waiting() {
    const Network& nw = out_.network;
    size_t w = 0;
    for (int g : waiting_) {
      if (state_[g] != kWaiting) continue;
      if (settled(nw, g))
        enter(nw, g);
      else
        waiting_[w++] = g;
    }
    waiting_.resize(w);
  }

  static uint64_t bits(double x) {
    uint64_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
  }

  void enter(const Network& nw, int g) {
    const std::array<uint64_t, 3> key{bits(nw.links[b_.worker[g]].v.back()), bits(b_.size[g]),
                                      bits(b_.send_at[g])};
    auto it = bucket_index_.find(key);
    if (it == bucket_index_.end()) {
      it = bucket_index_.emplace(key, static_cast<int>(buckets_.size())).first;
      buckets_.emplace_back();
      excluded_.push_back(0);
    }
    Bucket& bk = buckets_[it->second];
    bk.heap.push_back(g);
    std::push_heap(bk.heap.begin(), bk.heap.end(), std::greater<int>());
    ++bk.live;
    state_[g] = kBucketed;
    bucket_of_[g] = it->second;
  }

  bool member(int g, int k) const { return state_[g] == kBucketed && bucket_of_[g] == k; }

  int leader(int k) {
    Bucket& bk = buckets_[k];
    if (bk.live == 0) return -1;
    while (!member(bk.heap.front(), k)) {
      std::pop_heap(bk.heap.begin(), bk.heap.end(), std::greater<int>());
      bk.heap.pop_back();
    }
    return bk.heap.front();
  }

  // An update of worker w was reserved: w's bucketed updates wait until w's egress settles.
  void egress_changed(int w) {
    for (int g : host_members_[w]) {
      if (state_[g] != kBucketed) continue;
      --buckets_[bucket_of_[g]].live;
      state_[g] = kWaiting;
      waiting_.push_back(g);
    }
  }

  // Alg. 2's look-ahead on nw (cur reserved): does some update of the next pick's pool finish
  // before `end`? The pool at pos2: the live updates (dl >= pos2) due there, else all of them.
  // `first` indexes by_deadline_'s first entry with dl >= pos2.
  bool next_finishes_before(const Network& nw, double pos2, size_t first, int cur, double end) {
    bool due = false;
    for (size_t i = first; i < by_deadline_.size() && deadline(i) <= pos2; ++i) {
      const int g = by_deadline_[i];
      if (state_[g] == kGone) continue;
      due = true;
      if (t_en(nw, g, nullptr, end) < end) return true;
    }
    if (due) return false;
    // Every live update. Buckets stand for their members except the ones not live at pos2
    // and cur's worker's (its egress has just changed): those are marked and looked at alone.
    const int w_cur = b_.worker[cur];
    auto exclude = [&](int g) {
      if (mark_[g] || state_[g] == kGone) return;
      mark_[g] = 1;
      marked_.push_back(g);
      if (state_[g] == kBucketed) ++excluded_[bucket_of_[g]];
    };
    for (int g : stale_next_) exclude(g);
    for (int g : host_members_[w_cur]) exclude(g);
    bool found = false;
    for (size_t k = 0; k < buckets_.size() && !found; ++k) {
      if (buckets_[k].live - excluded_[k] <= 0) continue;
      for (int g : buckets_[k].heap) {  // any unmarked member computes the bucket's end
        if (member(g, static_cast<int>(k)) && !mark_[g]) {
          found = t_en(nw, g, nullptr, end) < end;
          break;
        }
      }
    }
    auto alone = [&](int g) {
      return !found && state_[g] != kGone && b_.deadline[g] >= pos2 && g != cur &&
             (!mark_[g] || b_.worker[g] == w_cur) && t_en(nw, g, nullptr, end) < end;
    };
    for (int g : waiting_) found = found || alone(g);
    for (int g : solo_) found = found || (state_[g] == kSolo && alone(g));
    for (int g : host_members_[w_cur])
      found = found || (state_[g] == kBucketed && alone(g));
    for (int g : marked_) {
      mark_[g] = 0;
      if (state_[g] == kBucketed) excluded_[bucket_of_[g]] = 0;
    }
    marked_.clear();
    return found;
  }

  const Batch& b_;
  Paths paths_;
  const int n_;
  const int ingress_;  // the server's ingress link
  Ordering out_;
  std::vector<uint8_t> state_;
  std::vector<int> bucket_of_;
  std::vector<uint8_t> mark_;
  std::vector<std::vector<int>> host_members_;
  std::vector<int> by_deadline_;  // update indices by (deadline, id)
  size_t dl_lo_ = 0;              // by_deadline_[..dl_lo_) are stale
  int remaining_ = 0;
  std::vector<int> waiting_, solo_, due_, stale_, stale_next_, marked_, excluded_;
  std::vector<Bucket> buckets_;
  std::map<std::array<uint64_t, 3>, int> bucket_index_;
  Journal journal_;
};

// --- Alg. 3: aggregation ------------------------------------------------------------------------

class Aggregator {
 public:
  Aggregator(const Network& base, const Batch& b, const Ordering& o, Mode mode)
      : base_(base), b_(b), o_(o), mode_(mode), path_(base.max_path()) {}

  Grouping run() {
    const int n_all = static_cast<int>(o_.order.size());
    Grouping g;
    g.cases.assign(n_all + 1, kInf);
    int best = 0;
    if (mode_ == Mode::plain) {
      // the paper's loop: every case from scratch on a copy of the network
      for (int n = 0; n <= n_all; ++n) {
        Network nw = base_;
        g.cases[n] = det_agg(nw, n, kInf, nullptr, nullptr);
      }
      for (int n = 1; n <= n_all; ++n)
        if (g.cases[n] < g.cases[best]) best = n;
    } else {
      // Case n's direct group is case n-1's plus one transfer: carry it, and run each case's
      // aggregators on a journal that is undone afterwards. A case stops as soon as its t_max
      // reaches the best makespan so far (t_max never decreases, and the first minimal case wins,
      // so such a case can never be chosen); once the direct group alone reaches it, every later
      // case does too. t_max is a running max of the case's own arrivals, so this holds however
      // an aggregate's transfer is computed, cut-through relays included; the pipeline is a
      // separate candidate, evaluated in full afterwards.
      Network prefix = base_;
      Journal journal;
      double prefix_max = b_.start;
      double best_ms = kInf;
      for (int n = 0; n <= n_all; ++n) {
        if (n > 0) {
          replay_direct(prefix, n - 1);
          prefix_max = pymax(prefix_max, o_.transfers.end[n - 1]);
        }
        if (prefix_max >= best_ms) break;
        const double ms = tail(prefix, n, prefix_max, best_ms, &journal, nullptr);
        prefix.undo(journal);
        g.cases[n] = ms;
        if (ms < best_ms) {
          best_ms = ms;
          best = n;
        }
      }
    }
    // Cut-through: the pipeline, on the original network, replaces the best case when it ends
    // no later (aggregation.aggregate). An infeasible batch is refused (fast.py), pipeline or not.
    if (b_.cut_through && g.cases[best] < kInf) {
      Network chain = base_;
      g.pipeline = pipeline(chain, &g);
      if (g.pipeline <= g.cases[best]) {  // cases[best] is DetAgg(best)'s makespan
        g.pipeline_chosen = true;
        g.n_direct = 0;
        g.makespan = g.pipeline;
        g.network = std::move(chain);
        return g;
      }
    }
    // DetAgg(best) again, recording its groups
    g.network = base_;
    g.n_direct = best;
    g.makespan = det_agg(g.network, best, kInf, nullptr, &g);
    return g;
  }

 private:
  // The direct group's transfer at position i, as ordering computed it: DetAgg's direct sends
  // start from the same network and reserve the same transfers in the same order, so they are
  // the same computation (§5.2: "does not alter the transfer schedules for updates in group 1").
  void replay_direct(Network& nw, int i) {
    const int u = o_.order[i];
    const int np = nw.path(b_.worker[u], b_.server, path_.data());
    segs_.assign(o_.transfers.segs.begin() + o_.transfers.off[i],
                 o_.transfers.segs.begin() + o_.transfers.off[i + 1]);
    if (!segs_.empty()) nw.reserve(path_.data(), np, segs_);
  }

  // DetAgg(n) on nw: the direct group (recomputed in plain mode, replayed in fast mode), then
  // the aggregators.
  double det_agg(Network& nw, int n, double prune, Journal* j, Grouping* rec) {
    double t_max = b_.start;
    for (int i = 0; i < n; ++i) {
      const int u = o_.order[i];
      if (mode_ == Mode::plain) {
        const int np = nw.path(b_.worker[u], b_.server, path_.data());
        segs_.clear();
        const double end = nw.t_en(path_.data(), np, b_.size[u], b_.send_at[u], &segs_, kInf);
        if (!segs_.empty()) nw.reserve(path_.data(), np, segs_);
        t_max = pymax(t_max, end);
        if (rec != nullptr && !same_as_ordering(i, end)) {
          throw std::logic_error("sched: DetAgg's direct group differs from the ordering's "
                                 "transfers (internal error)");
        }
      } else {
        replay_direct(nw, i);
        t_max = pymax(t_max, o_.transfers.end[i]);
      }
    }
    return tail(nw, n, t_max, prune, j, rec);
  }

  bool same_as_ordering(int i, double end) const {
    const auto& tr = o_.transfers;
    const int64_t a = tr.off[i], len = tr.off[i + 1] - tr.off[i];
    if (!(tr.end[i] == end) || len != static_cast<int64_t>(segs_.size())) return false;
    for (int64_t k = 0; k < len; ++k) {
      const Seg& s = tr.segs[a + k];
      if (!(s.t0 == segs_[k].t0 && s.t1 == segs_[k].t1 && s.rate == segs_[k].rate)) return false;
    }
    return true;
  }

  // The rest of DetAgg(n) after the direct group, whose last arrival is t_max: the ordered
  // updates from position n stream to the aggregators in their order. Returns the makespan;
  // +inf when infeasible, or (fast mode) as soon as t_max reaches `prune`.
  double tail(Network& nw, int n, double t_max, double prune, Journal* j, Grouping* rec) {
    const int n_all = static_cast<int>(o_.order.size());
    const bool fast = mode_ == Mode::fast;
    int i = n;
    bool constrained = n > 0;
    for (int agg : b_.aggs) {
      if (i >= n_all) break;
      int members = 0;
      double size = 0.0, ready = 0.0, first = 0.0;  // first: the latest inbound start
      // an update joins this group only if it arrives by t_max: a walk that passes t_max cannot
      const double cut = (fast && constrained) ? std::nextafter(t_max, kInf) : kInf;
      while (i < n_all) {
        const int u = o_.order[i];
        const int np = nw.path(b_.worker[u], agg, path_.data());
        segs_.clear();
        const double end = nw.t_en(path_.data(), np, b_.size[u], b_.send_at[u], &segs_, cut);
        if (end == kInf || (constrained && end > t_max)) break;
        if (!segs_.empty()) nw.reserve(path_.data(), np, segs_, j);
        const double begin = segs_.empty() ? end : segs_[0].t0;  // aggregation._transfer's start
        if (members == 0) {
          size = b_.size[u];
          ready = end;
          first = begin;
        } else {
          size = pymax(size, b_.size[u]);
          ready = pymax(ready, end);
          first = pymax(first, begin);
        }
        ++members;
        if (rec != nullptr) rec->inbound.add(end, segs_);
        ++i;
      }
      if (members == 0) continue;
      if (members > 1) size = size * b_.agg_scale;  // x 1.0 for one member changes nothing
      const int np = nw.path(agg, b_.server, path_.data());
      segs_.clear();
      // cut-through: the sum streams out from the last member's start, never ending before it
      const double end = b_.cut_through
                             ? nw.t_en_relay(path_.data(), np, size, first, ready, &segs_)
                             : nw.t_en(path_.data(), np, size, ready, &segs_, kInf);
      if (end == kInf) return kInf;
      if (!segs_.empty()) nw.reserve(path_.data(), np, segs_, j);
      t_max = pymax(t_max, end);
      constrained = true;
      if (rec != nullptr) {
        rec->agg_host.push_back(agg);
        rec->agg_count.push_back(members);
        rec->agg_transfer.add(end, segs_);
      }
      if (fast && t_max >= prune) return kInf;
    }
    if (i < n_all) return kInf;
    return t_max;
  }

  // aggregation.pipeline on nw (a copy of the original network): the batch's hosts, the one
  // whose updates are ready first first, pass one running sum down the line, each adding its own
  // updates, the last sending it to the server; every hop a t_en_relay. Records the chain into
  // rec->pipe_hosts and rec->pipe (see Grouping). Returns its makespan; +inf when not possible.
  double pipeline(Network& nw, Grouping* rec) {
    const int n_all = static_cast<int>(o_.order.size());
    std::vector<int> slot(nw.hosts(), -1);   // host -> index in hosts
    std::vector<int>& hosts = rec->pipe_hosts;
    std::vector<std::vector<int>> mine;      // per host of hosts: its positions, in order
    std::vector<double> ready;               // per host of hosts: its latest send time
    for (int i = 0; i < n_all; ++i) {
      const int u = o_.order[i];
      const int h = b_.worker[u];
      if (slot[h] < 0) {
        slot[h] = static_cast<int>(hosts.size());
        hosts.push_back(h);
        mine.emplace_back();
        ready.push_back(b_.send_at[u]);
      } else {
        ready[slot[h]] = pymax(ready[slot[h]], b_.send_at[u]);
      }
      mine[slot[h]].push_back(i);
    }
    // hosts by ready time, ties in the order's (Python's stable sort)
    std::vector<int> by_ready(hosts.size());
    for (size_t k = 0; k < hosts.size(); ++k) by_ready[k] = static_cast<int>(k);
    std::stable_sort(by_ready.begin(), by_ready.end(),
                     [&](int a, int b) { return ready[a] < ready[b]; });
    std::vector<int> sorted_hosts;
    for (int k : by_ready) sorted_hosts.push_back(hosts[k]);
    hosts = sorted_hosts;
    if (hosts.size() < 2 || slot[b_.server] >= 0) return kInf;
    for (size_t k = 1; k < hosts.size(); ++k)
      if (std::find(b_.aggs.begin(), b_.aggs.end(), hosts[k]) == b_.aggs.end()) return kInf;

    // the first host's own updates go to the second host, one by one
    const std::vector<int>& first = mine[slot[hosts[0]]];
    double in_start = 0.0, in_end = 0.0;  // latest start and end of what comes into the next host
    int np = nw.path(hosts[0], hosts[1], path_.data());
    for (size_t k = 0; k < first.size(); ++k) {
      const int u = o_.order[first[k]];
      segs_.clear();
      const double end = nw.t_en(path_.data(), np, b_.size[u], b_.send_at[u], &segs_, kInf);
      if (end == kInf) return kInf;
      if (!segs_.empty()) nw.reserve(path_.data(), np, segs_);
      rec->pipe.add(end, segs_);
      const double begin = segs_.empty() ? end : segs_[0].t0;
      in_start = k == 0 ? begin : pymax(in_start, begin);
      in_end = k == 0 ? end : pymax(in_end, end);
    }
    std::vector<char> member(n_all, 0);   // by position: in the running sum
    for (int i : first) member[i] = 1;
    double end = kInf;
    for (size_t k = 1; k < hosts.size(); ++k) {
      // its own updates join with no network: start = end = their send time
      for (int i : mine[slot[hosts[k]]]) {
        in_start = pymax(in_start, b_.send_at[o_.order[i]]);
        in_end = pymax(in_end, b_.send_at[o_.order[i]]);
        member[i] = 1;
      }
      double size = 0.0;  // the largest member, first maximum in the order (Python's max)
      bool any = false;
      for (int i = 0; i < n_all; ++i) {
        if (!member[i]) continue;
        size = any ? pymax(size, b_.size[o_.order[i]]) : b_.size[o_.order[i]];
        any = true;
      }
      size = size * b_.agg_scale;
      const int dst = k + 1 < hosts.size() ? hosts[k + 1] : b_.server;
      np = nw.path(hosts[k], dst, path_.data());
      segs_.clear();
      end = nw.t_en_relay(path_.data(), np, size, in_start, in_end, &segs_);
      if (end == kInf) return kInf;
      if (!segs_.empty()) nw.reserve(path_.data(), np, segs_);
      rec->pipe.add(end, segs_);
      in_start = segs_.empty() ? end : segs_[0].t0;  // the next host's inbound: this sum
      in_end = end;
    }
    return end;
  }

  const Network& base_;
  const Batch& b_;
  const Ordering& o_;
  Mode mode_;
  std::vector<int> path_;
  std::vector<Seg> segs_;
};

}  // namespace

Ordering order_updates(const Network& base, const Batch& b, Mode mode) {
  if (mode == Mode::plain) return PlainOrderer(base, b).run();
  return FastOrderer(base, b).run();
}

Grouping aggregate(const Network& base, const Batch& b, const Ordering& o, Mode mode) {
  return Aggregator(base, b, o, mode).run();
}

}  // namespace sched
}  // namespace mlf
