// sched_fast.h — the scheduler's fast path (mlfabric.sched.fast): the network model of paper
// §5.1 / Fig. 4 (piecewise-constant residual capacity per link, t_en, NetUp), update ordering
// (Alg. 2, §5.1.2-5.1.3) and in-network aggregation (Alg. 3, §5.2), with or without cut-through
// aggregates (aggregation.py's cut_through: Network.t_en_relay and the pipeline case).
//
// Contract: every function here computes EXACTLY what mlfabric/sched/network.py, ordering.py and
// aggregation.py compute — same order, same drop reasons, same chosen case, same groups, same
// segments, bit-identical floats — because it performs the same float operations in the same
// order (sched_fast.cc keeps FP contraction off). The speed-ups (see docs/sched/fast.md) only skip
// work whose result provably cannot change the answer; Mode::plain runs the paper's loops as the
// Python reference does, for the side-by-side benchmark.
//
// Never touches Python, MPI or the GIL; single-threaded; callers own all inputs and outputs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mlf {
namespace sched {

// Residual capacity of one link: v[k] bytes/s on [t[k], t[k+1]), the last value forever;
// t[0] == 0 and no two neighbours are equal (network.Profile's invariant).
struct Profile {
  std::vector<double> t, v;

  Profile() = default;
  Profile(Profile&&) = default;
  Profile& operator=(Profile&&) = default;
  Profile& operator=(const Profile& o) {  // assign: keeps this profile's capacity
    t.assign(o.t.begin(), o.t.end());
    v.assign(o.v.begin(), o.v.end());
    return *this;
  }
  // A copy gets room for a few more breakpoints: a reservation adds at most two, and networks
  // are copied to be reserved on.
  Profile(const Profile& o) {
    t.reserve(o.t.size() + kSlack);
    v.reserve(o.v.size() + kSlack);
    t.assign(o.t.begin(), o.t.end());
    v.assign(o.v.begin(), o.v.end());
  }
  static constexpr size_t kSlack = 6;
};

// A transfer sends at `rate` over [t0, t1) (network.Segment).
struct Seg {
  double t0, t1, rate;
};

// Saved copies of links modified since a mark, so a tentative reservation can be undone in
// O(links touched) instead of copying the whole network (Alg. 2's look-ahead, Alg. 3's cases).
// A network serves one journal at a time: it stamps the links saved since the last undo/commit.
struct Journal {
  std::vector<std::pair<int, Profile>> saved;
  size_t used = 0;
};

// Links 0..H-1 are the hosts' egress, H..2H-1 their ingress, 2H.. the core links. A path is
// egress(src) + the pair's core links (if given) + ingress(dst); empty on one host.
class Network {
 public:
  static constexpr double kNoCap = std::numeric_limits<double>::infinity();

  Network() = default;
  Network(int hosts, std::vector<Profile> links,
          std::unordered_map<int64_t, std::vector<int>> core_paths);

  int hosts() const { return hosts_; }
  int max_path() const { return max_path_; }
  // Writes the link indices from src to dst into out (max_path() entries); returns how many.
  int path(int src, int dst, int* out) const;

  // network.t_en: when `size` bytes starting at `start` finish on these links, taking the whole
  // residual bottleneck rate at every instant; +inf when the path never has capacity again.
  // Appends the segments to *segs when segs is not null. `cut`: the caller only needs to know
  // whether the end is < cut; the walk stops (returning +inf) as soon as its time reaches cut,
  // which is exact because the end is never earlier than any time the walk has reached.
  // `cap` < +inf: one more link of that constant capacity at the end of the path (t_en_relay's
  // rate cap; network.py appends it as the last Profile, so it is compared last here too).
  double t_en(const int* path, int n, double size, double start, std::vector<Seg>* segs,
              double cut, double cap = kNoCap) const;

  // network.Network.t_en_relay: `size` bytes relayed cut-through, forwarded as they come in on
  // an inbound transfer over [start, inbound_end). Appends the segments to *segs.
  double t_en_relay(const int* path, int n, double size, double start, double inbound_end,
                    std::vector<Seg>* segs) const;

  // NetUp (network.Network.reserve): take each segment's rate off every link of the path over
  // its interval. With a journal, each link's first change after the journal's reset is saved.
  void reserve(const int* path, int n, const std::vector<Seg>& segs, Journal* j = nullptr);
  void undo(Journal& j);   // restore every link saved in j, and reset it
  void commit(Journal& j); // forget the saved copies (keep the changes), and reset j

  std::vector<Profile> links;

 private:
  void save(int k, Journal* j);
  void subtract(Profile& p, double t0, double t1, double rate);

  int hosts_ = 0;
  int max_path_ = 0;
  std::unordered_map<int64_t, std::vector<int>> core_;  // src * hosts + dst -> core link indices
  std::vector<uint32_t> stamp_;                          // journal epoch of each link's last save
  uint32_t epoch_ = 1;
};

// One batch, updates in ascending id order (the reference's tie-break order).
struct Batch {
  int server = 0;
  double start = 0.0;
  std::vector<int> worker;
  std::vector<double> size;
  std::vector<double> send_at;   // max(ready, start), as Python computes it
  std::vector<double> deadline;  // dl(g) = v(g) + tau_max - v_init (eq. 9)
  std::vector<int> aggs;         // aggregators in their pre-assigned group order
  double agg_scale = 1.0;        // an aggregate of >= 2 members: largest member x agg_scale
  bool cut_through = false;      // aggregates stream out as members come in; try the pipeline
};

enum class Mode { fast, plain };

// Transfers as a table: transfer i has end[i] and segments segs[off[i] .. off[i+1]).
struct TransferTable {
  std::vector<double> end;
  std::vector<int64_t> off{0};
  std::vector<Seg> segs;
  void add(double e, const std::vector<Seg>& s);
  size_t size() const { return end.size(); }
};

// Drop reasons, as plan.DROP_* (codes shared with mlfabric/sched/fast.py).
enum Drop : int8_t { kStale = 0, kLookahead = 1, kNoPath = 2 };

struct Ordering {                       // ordering.Ordering
  std::vector<int> order;               // update indices by position
  std::vector<std::pair<int, int8_t>> dropped;  // (update index, Drop), in the reference's order
  TransferTable transfers;              // per position: the update's transfer to the server
  Network network;                      // after reserving them
};

struct Grouping {                       // aggregation.Grouping
  int n_direct = 0;
  double makespan = 0.0;
  std::vector<double> cases;            // per n = 0..|order|; +inf: infeasible (or pruned, fast)
  std::vector<int> agg_host;            // per aggregate: its aggregator
  std::vector<int> agg_count;           // per aggregate: members (consecutive positions)
  TransferTable inbound;                // per member after the direct group: to its aggregator
  TransferTable agg_transfer;           // per aggregate: to the server
  Network network;                      // after everything is reserved
  // cut_through: the pipeline case (aggregation.pipeline). pipeline is its makespan (+inf: not
  // possible, or not cut_through). When pipeline_chosen, it replaces the groups above (n_direct
  // 0, no aggregates; makespan and network are the pipeline's): pipe_hosts are the chain's hosts
  // in order, and pipe holds the first host's update transfers (to pipe_hosts[1], in the order's
  // sequence) then each later host's sum to the next host (the last one's to the server).
  double pipeline = std::numeric_limits<double>::infinity();
  bool pipeline_chosen = false;
  std::vector<int> pipe_hosts;
  TransferTable pipe;
};

// Alg. 2 (ordering.order_updates) and Alg. 3 (aggregation.aggregate) over `base`, unmodified.
Ordering order_updates(const Network& base, const Batch& b, Mode mode);
Grouping aggregate(const Network& base, const Batch& b, const Ordering& o, Mode mode);

}  // namespace sched
}  // namespace mlf
