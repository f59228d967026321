#include "algorithms.h"

#include <cstring>
#include <set>
#include <sstream>

#include "chorus/comm/check.h"
#include "chorus/comm/log.h"
#include "measured_allreduce.h"
#include "plan.h"
#include "reduce.h"

namespace chorus::algo {

using transport::Ticket;
using transport::Transport;

char* Scratch::get(int slot, size_t bytes) {
  if (slots_.size() <= static_cast<size_t>(slot)) slots_.resize(static_cast<size_t>(slot) + 1);
  auto& v = slots_[static_cast<size_t>(slot)];
  if (v.size() < bytes) {
    v.clear();
    v.shrink_to_fit();
    v.resize(bytes);
  }
  return v.data();
}

namespace {

// Byte offsets of the blocks of `sizes`, back to back.
std::vector<size_t> displacements(const std::vector<size_t>& sizes) {
  std::vector<size_t> displs(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) displs[i] = displs[i - 1] + sizes[i - 1];
  return displs;
}

inline char* at(void* base, size_t elems, size_t esz) { return static_cast<char*>(base) + elems * esz; }
inline const char* at(const void* base, size_t elems, size_t esz) {
  return static_cast<const char*>(base) + elems * esz;
}

// Ring reduce-scatter (steps [0, n-1)) and/or allgather (steps [n-1, 2n-2)) over `plan`, in place
// on buf, pipelined by segment: segment j of step s+1 leaves as soon as segment j of step s is in.
void ring(Transport& t, Scratch& s, const wire::Call& call, const plan::RingPlan& plan, char* buf,
          DataType dtype, ReduceOp op, bool reduce_scatter, bool allgather) {
  const int n = t.size();
  const int r = t.rank();
  const int next = (r + 1) % n;
  const int prev = (r - 1 + n) % n;
  const size_t esz = element_size(dtype);
  const int first = reduce_scatter ? 0 : n - 1;
  const int last = allgather ? plan.steps() : n - 1;  // exclusive
  size_t seg_max = 0;
  for (int j = 0; j < plan.segments; ++j) seg_max = std::max(seg_max, plan.segment(0, j).count);
  char* tmp = reduce_scatter ? s.get(0, seg_max * esz) : nullptr;

  auto send_segment = [&](int step, int j) {
    plan::Range g = plan.segment(plan.send_chunk(r, step), j);
    t.send(next, wire::make_header(call, g.count * esz), at(buf, g.offset, esz), g.count * esz);
  };
  for (int j = 0; j < plan.segments; ++j) send_segment(first, j);
  for (int step = first; step < last; ++step) {
    const int c = plan.recv_chunk(r, step);
    const bool reducing = step < n - 1;
    for (int j = 0; j < plan.segments; ++j) {
      plan::Range g = plan.segment(c, j);
      // A segment outside the buffer, or larger than the scratch it is received into, would
      // overwrite memory that is not the caller's.
      CHORUS_CHECK(g.offset + g.count <= plan.count && g.count <= seg_max, "ring segment out of its buffer");
      char* dst = at(buf, g.offset, esz);
      if (reducing) {
        t.wait(t.recv(prev, call, tmp, g.count * esz));
        reduce::reduce_into(dtype, op, dst, tmp, g.count);
        if (step == n - 2 && op == ReduceOp::kAvg) reduce::finish_avg(dtype, dst, g.count, n);
      } else {
        t.wait(t.recv(prev, call, dst, g.count * esz));
      }
      if (step + 1 < last) send_segment(step + 1, j);
    }
  }
  t.wait_all();
}

// One step of recursive doubling or Rabenseifner: `send` goes to `partner` and `recv` comes back
// from it (element ranges of the buffer), reduced into the buffer at `recv` or copied there.
struct Exchange {
  int partner;
  plan::Range send;
  plan::Range recv;
  bool reduce;
};

// Runs `steps` in order on buf (scratch `tmp` holds a received block before it is reduced), then
// calls done_reducing() after the last reducing step. A step whose blocks are large enough
// (plan::exchange_needs_ready) starts with a ready handshake: each partner sends a zero-byte word
// and waits for the other's before its block leaves. A rank sends that word once it has received
// the whole block of its previous step (before it reduces it, so the word's trip overlaps the
// reduction), so its link carries no earlier step's data when the new block arrives. Without it a
// rank that is ahead sends to one still receiving from its previous partner: two flows converge on
// one link, the switch's queue overflows and TCP waits out retransmission timeouts (up to 2x the
// ring's time on 1 Gbit/s and 100 Mbit/s links at 8 hosts, docs/algorithms.md).
template <typename DoneReducing>
void exchange_steps(Transport& t, const Tuning& tune, const wire::Call& call,
                    const std::vector<Exchange>& steps, char* buf, char* tmp, DataType dtype, ReduceOp op,
                    DoneReducing done_reducing) {
  const size_t esz = element_size(dtype);
  auto ready = [&](size_t i) {
    return i < steps.size() &&
           plan::exchange_needs_ready(steps[i].send.count * esz, steps[i].recv.count * esz, tune.link);
  };
  auto say_ready = [&](size_t i) { t.send(steps[i].partner, wire::make_header(call, 0), nullptr, 0); };
  if (ready(0)) say_ready(0);
  for (size_t i = 0; i < steps.size(); ++i) {
    const Exchange& x = steps[i];
    if (ready(i)) t.wait(t.recv(x.partner, call, nullptr, 0));
    const size_t send_bytes = x.send.count * esz;
    t.send(x.partner, wire::make_header(call, send_bytes), at(buf, x.send.offset, esz), send_bytes);
    t.wait(t.recv(x.partner, call, x.reduce ? tmp : at(buf, x.recv.offset, esz), x.recv.count * esz));
    if (ready(i + 1)) say_ready(i + 1);
    // The send reads its block: a reduction into the same elements (recursive doubling's whole
    // buffer) waits until it is out; one into others (Rabenseifner's kept half) runs first.
    const bool overlap =
        x.send.offset < x.recv.offset + x.recv.count && x.recv.offset < x.send.offset + x.send.count;
    if (overlap) t.wait_all();
    if (x.reduce) {
      reduce::reduce_into(dtype, op, at(buf, x.recv.offset, esz), tmp, x.recv.count);
      if (i + 1 == steps.size() || !steps[i + 1].reduce) done_reducing();
    }
    t.wait_all();
  }
}

}  // namespace

void learn_shared_cores(Transport& t, const Tuning& tune, const wire::Call& call) {
  const size_t n = static_cast<size_t>(t.size());
  const plan::RankCpus mine = transport::this_rank_cpus();
  std::vector<plan::RankCpus> all(n);
  // The call's own fields, so that a mismatch names the caller's allreduce; its arg marks the gather.
  wire::Call gather = call;
  gather.arg = wire::kSharedCoresArg;
  allgatherv(t, gather, &mine, all.data(), std::vector<size_t>(n, sizeof(plan::RankCpus)));
  tune.cores->ranks_per_core = plan::ranks_per_core(all);
  tune.cores->link = plan::on_shared_cores(tune.link, tune.cores->ranks_per_core);
  tune.cores->known = true;
  std::set<uint64_t> machines;
  for (const plan::RankCpus& r : all) machines.insert(r.machine);
  std::ostringstream line;
  line << "allreduce \"auto\" over " << n << " ranks on " << machines.size() << " machine(s): at most "
       << tune.cores->ranks_per_core << " ranks a core; the plan takes a message's latency as "
       << tune.cores->link.alpha_us << " us (the link's "
       << tune.link.alpha_us << ")";
  log(LogLevel::kDebug, line.str());
}

void allreduce(Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, void* buf,
               size_t count, DataType dtype, ReduceOp op) {
  if (t.size() == 1) {
    return;  // sum/min/max/prod/avg of one contribution is itself
  }
  if (tune.allreduce == AllreduceAlgorithm::kTuned && tune.measured) {
    return tune.measured->run(t, s, tune, call, buf, count, dtype, op);
  }
  if (tune.allreduce == AllreduceAlgorithm::kAuto && tune.cores && !tune.cores->known) {
    learn_shared_cores(t, tune, call);
  }
  allreduce_by(tune.allreduce, t, s, tune, call, buf, count, dtype, op);
}

void allreduce_by(AllreduceAlgorithm algorithm, Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                  void* buf, size_t count, DataType dtype, ReduceOp op) {
  // "auto" plans on the link as the ranks' shared cores slow it; a forced algorithm needs no model.
  const bool shared = algorithm == AllreduceAlgorithm::kAuto && tune.cores && tune.cores->known;
  const plan::LinkModel& model = shared ? tune.cores->link : tune.link;
  switch (plan::choose_allreduce(algorithm, count * element_size(dtype), count, t.size(), model)) {
    case AllreduceAlgorithm::kRing: return allreduce_ring(t, s, tune, call, buf, count, dtype, op);
    case AllreduceAlgorithm::kRabenseifner: return allreduce_rabenseifner(t, s, tune, call, buf, count, dtype, op);
    default: return allreduce_recursive_doubling(t, s, tune, call, buf, count, dtype, op);
  }
}

void allreduce_recursive_doubling(Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call,
                                  void* buf, size_t count, DataType dtype, ReduceOp op) {
  const int n = t.size();
  const int r = t.rank();
  const size_t bytes = count * element_size(dtype);
  const int p = plan::pow2_floor(n);
  const int extra = n - p;
  const wire::Header h = wire::make_header(call, bytes);
  char* tmp = s.get(0, bytes);
  if (r >= p) {
    // Fold in: hand the data to rank r - p, get the final result back.
    t.send(r - p, h, buf, bytes);
    t.wait(t.recv(r - p, call, buf, bytes));
    t.wait_all();
    return;
  }
  if (r < extra) {
    t.wait(t.recv(r + p, call, tmp, bytes));
    reduce::reduce_into(dtype, op, buf, tmp, count);
  }
  std::vector<Exchange> steps;
  for (int mask = 1; mask < p; mask <<= 1) steps.push_back({r ^ mask, {0, count}, {0, count}, true});
  exchange_steps(t, tune, call, steps, static_cast<char*>(buf), tmp, dtype, op, [&] {
    if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, buf, count, n);
  });
  if (r < extra) {
    t.send(r + p, h, buf, bytes);
    t.wait_all();
  }
}

// Ranks past the largest power of two p fold in (rank r hands its buffer to r - p and gets the
// result back), as in recursive doubling. Among the p ranks the buffer is cut into p blocks
// (plan::split). Reduce-scatter by recursive halving: at distance d = p/2, p/4, ..., 1 each rank
// keeps half of its current window of blocks (the lower half where its bit d is clear), sends the
// other half to rank ^ d and reduces what it receives into the half it keeps; rank r ends with
// block r reduced over every rank. Allgather by recursive doubling reverses it: at d = 1, 2, ...,
// p/2 partners swap windows, which double. Every rank's block is reduced once, on one rank, so all
// ranks end with the same bytes.
void allreduce_rabenseifner(Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, void* buf,
                            size_t count, DataType dtype, ReduceOp op) {
  const int n = t.size();
  const int r = t.rank();
  const size_t esz = element_size(dtype);
  const size_t bytes = count * esz;
  const int p = plan::pow2_floor(n);
  const int extra = n - p;
  CHORUS_CHECK(count >= static_cast<size_t>(p), "rabenseifner allreduce needs an element per block");
  char* data = static_cast<char*>(buf);
  if (r >= p) {
    t.send(r - p, wire::make_header(call, bytes), data, bytes);
    t.wait(t.recv(r - p, call, data, bytes));
    t.wait_all();
    return;
  }
  char* tmp = s.get(0, bytes);
  if (r < extra) {
    t.wait(t.recv(r + p, call, tmp, bytes));
    reduce::reduce_into(dtype, op, data, tmp, count);
  }
  // Elements of blocks [lo, hi).
  auto window = [&](int lo, int hi) {
    const plan::Range first = plan::split(count, p, lo);
    const plan::Range last = plan::split(count, p, hi - 1);
    return plan::Range{first.offset, last.offset + last.count - first.offset};
  };
  std::vector<Exchange> steps;
  int lo = 0, hi = p;
  for (int d = p / 2; d >= 1; d /= 2) {
    const int mid = lo + (hi - lo) / 2;
    const bool keep_low = (r & d) == 0;
    const plan::Range keep = keep_low ? window(lo, mid) : window(mid, hi);
    const plan::Range give = keep_low ? window(mid, hi) : window(lo, mid);
    steps.push_back({r ^ d, give, keep, true});
    if (keep_low) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  const plan::Range reduced = window(lo, hi);  // block r, reduced over every rank
  for (int d = 1; d < p; d *= 2) {
    const int size = hi - lo;
    const bool low = (r & d) == 0;  // this rank's window is the lower half of the doubled one
    const plan::Range theirs = low ? window(hi, hi + size) : window(lo - size, lo);
    steps.push_back({r ^ d, window(lo, hi), theirs, false});
    if (low) {
      hi += size;
    } else {
      lo -= size;
    }
  }
  exchange_steps(t, tune, call, steps, data, tmp, dtype, op, [&] {
    if (op == ReduceOp::kAvg) reduce::finish_avg(dtype, at(data, reduced.offset, esz), reduced.count, n);
  });
  if (r < extra) {
    t.send(r + p, wire::make_header(call, bytes), data, bytes);
    t.wait_all();
  }
}

void allreduce_ring(Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, void* buf,
                    size_t count, DataType dtype, ReduceOp op) {
  const size_t esz = element_size(dtype);
  plan::RingPlan p = plan::make_ring_plan(count, t.size(), std::max<size_t>(1, tune.segment_bytes / esz));
  ring(t, s, call, p, static_cast<char*>(buf), dtype, op, true, true);
}

// The chain: ranks in order from the root (virtual rank v = rank - root mod n), each piece received
// from v - 1 and passed on to v + 1 while the next piece arrives, so every link carries the buffer
// once and the pipe fills in n - 1 steps.
void broadcast_chain(Transport& t, const Tuning& tune, const wire::Call& call, char* p, size_t bytes, int root) {
  const int n = t.size();
  const int v = (t.rank() - root + n) % n;
  const int prev = (t.rank() - 1 + n) % n;
  const int next = (t.rank() + 1) % n;
  const size_t seg = plan::chain_segment_bytes(bytes, n, tune.segment_bytes);
  const size_t pieces = std::max<size_t>(1, (bytes + seg - 1) / seg);
  for (size_t i = 0; i < pieces; ++i) {
    plan::Range g = plan::split(bytes, static_cast<int>(pieces), static_cast<int>(i));
    if (v > 0) t.wait(t.recv(prev, call, p + g.offset, g.count));
    if (v < n - 1) t.send(next, wire::make_header(call, g.count), p + g.offset, g.count);
  }
  t.wait_all();
}

void broadcast(Transport& t, const Tuning& tune, const wire::Call& call, void* buf, size_t bytes,
               int root) {
  const int n = t.size();
  if (n == 1) return;
  if (plan::choose_broadcast(tune.broadcast, bytes, n, tune.segment_bytes, tune.link) == plan::BroadcastShape::kChain) {
    return broadcast_chain(t, tune, call, static_cast<char*>(buf), bytes, root);
  }
  const int r = t.rank();
  const int parent = plan::binomial_parent(r, root, n);
  const std::vector<int> children = plan::binomial_children(r, root, n);
  // Segments let children forward the start of a large buffer while the rest still arrives.
  const size_t seg = std::max<size_t>(1, tune.segment_bytes);
  const size_t segments = std::max<size_t>(1, (bytes + seg - 1) / seg);
  char* p = static_cast<char*>(buf);
  for (size_t i = 0; i < segments; ++i) {
    plan::Range g = plan::split(bytes, static_cast<int>(segments), static_cast<int>(i));
    if (parent >= 0) t.wait(t.recv(parent, call, p + g.offset, g.count));
    for (int c : children) t.send(c, wire::make_header(call, g.count), p + g.offset, g.count);
  }
  t.wait_all();
}

void reduce(Transport& t, Scratch& s, const wire::Call& call, void* buf, size_t count, DataType dtype,
            ReduceOp op, int root) {
  const int n = t.size();
  const int r = t.rank();
  const size_t bytes = count * element_size(dtype);
  const int parent = plan::binomial_parent(r, root, n);
  std::vector<int> children = plan::binomial_children(r, root, n);
  // Nearest children first: the reverse of broadcast's order, as in a binomial reduction.
  char* acc = static_cast<char*>(buf);
  if (r != root && !children.empty()) {
    acc = s.get(1, bytes);
    if (bytes > 0) std::memcpy(acc, buf, bytes);  // no bytes: buf may be null
  }
  char* tmp = s.get(0, bytes);
  for (auto it = children.rbegin(); it != children.rend(); ++it) {
    t.wait(t.recv(*it, call, tmp, bytes));
    reduce::reduce_into(dtype, op, acc, tmp, count);
  }
  if (parent >= 0) {
    t.send(parent, wire::make_header(call, bytes), acc, bytes);
    t.wait_all();
  } else if (op == ReduceOp::kAvg) {
    reduce::finish_avg(dtype, buf, count, n);
  }
}

void allgatherv(Transport& t, const wire::Call& call, const void* in, void* out,
                const std::vector<size_t>& sizes) {
  const int n = t.size();
  const int r = t.rank();
  const std::vector<size_t> displs = displacements(sizes);
  char* o = static_cast<char*>(out);
  if (o + displs[static_cast<size_t>(r)] != in && sizes[static_cast<size_t>(r)] > 0) {
    std::memmove(o + displs[static_cast<size_t>(r)], in, sizes[static_cast<size_t>(r)]);
  }
  if (n == 1) return;
  const int next = (r + 1) % n;
  const int prev = (r - 1 + n) % n;
  // Step s forwards block (r - s) and receives block (r - s - 1).
  auto block = [&](int b) { return static_cast<size_t>(((b % n) + n) % n); };
  size_t b = block(r);
  t.send(next, wire::make_header(call, sizes[b]), o + displs[b], sizes[b]);
  for (int step = 0; step < n - 1; ++step) {
    size_t rb = block(r - step - 1);
    t.wait(t.recv(prev, call, o + displs[rb], sizes[rb]));
    if (step + 1 < n - 1) t.send(next, wire::make_header(call, sizes[rb]), o + displs[rb], sizes[rb]);
  }
  t.wait_all();
}

void gatherv(Transport& t, const wire::Call& call, const void* in, void* out, const std::vector<size_t>& sizes,
             int root) {
  const int n = t.size();
  const int r = t.rank();
  const size_t mine = sizes[static_cast<size_t>(r)];
  if (r != root) {
    t.send(root, wire::make_header(call, mine), in, mine);
    t.wait_all();
    return;
  }
  const std::vector<size_t> displs = displacements(sizes);
  char* o = static_cast<char*>(out);
  if (mine > 0 && o + displs[static_cast<size_t>(r)] != in) std::memmove(o + displs[static_cast<size_t>(r)], in, mine);
  for (int p = 0; p < n; ++p) {
    const size_t i = static_cast<size_t>(p);
    if (p != r) t.recv(p, call, o + displs[i], sizes[i]);
  }
  t.wait_all();
}

void scatterv(Transport& t, const wire::Call& call, const void* in, void* out, const std::vector<size_t>& sizes,
              int root) {
  const int n = t.size();
  const int r = t.rank();
  const size_t mine = sizes[static_cast<size_t>(r)];
  if (r != root) {
    t.wait(t.recv(root, call, out, mine));
    return;
  }
  const std::vector<size_t> displs = displacements(sizes);
  const char* i = static_cast<const char*>(in);
  for (int p = 0; p < n; ++p) {
    const size_t b = static_cast<size_t>(p);
    if (p != r) t.send(p, wire::make_header(call, sizes[b]), i + displs[b], sizes[b]);
  }
  if (mine > 0 && i + displs[static_cast<size_t>(r)] != out) std::memmove(out, i + displs[static_cast<size_t>(r)], mine);
  t.wait_all();
}

void gather(Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes, int root) {
  gatherv(t, call, in, out, std::vector<size_t>(static_cast<size_t>(t.size()), bytes), root);
}

void scatter(Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes, int root) {
  scatterv(t, call, in, out, std::vector<size_t>(static_cast<size_t>(t.size()), bytes), root);
}

void reduce_scatter(Transport& t, Scratch& s, const Tuning& tune, const wire::Call& call, const void* in,
                    void* out, size_t count, DataType dtype, ReduceOp op) {
  const int n = t.size();
  const size_t esz = element_size(dtype);
  const size_t total = count * static_cast<size_t>(n);
  if (n == 1) {
    if (count > 0 && in != out) std::memmove(out, in, count * esz);
    return;
  }
  if (total == 0) return;  // nothing to send or reduce (and memcpy of nothing from a null buffer is undefined)
  char* work = s.get(2, total * esz);
  std::memcpy(work, in, total * esz);
  // Segments no larger than a block keep every chunk boundary on a block boundary.
  plan::RingPlan p = plan::make_ring_plan(total, n, std::max<size_t>(1, tune.segment_bytes / esz));
  ring(t, s, call, p, work, dtype, op, true, false);
  plan::Range mine = p.chunk(t.rank());
  std::memcpy(out, work + mine.offset * esz, mine.count * esz);
}

void alltoall(Transport& t, const wire::Call& call, const void* in, void* out, size_t bytes) {
  const int n = t.size();
  const int r = t.rank();
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  for (int k = 1; k < n; ++k) {
    // Staggered partners spread the load instead of everyone sending to rank 0 first.
    int to = (r + k) % n;
    int from = (r - k + n) % n;
    t.send(to, wire::make_header(call, bytes), i + static_cast<size_t>(to) * bytes, bytes);
    t.recv(from, call, o + static_cast<size_t>(from) * bytes, bytes);
  }
  if (bytes > 0) std::memmove(o + static_cast<size_t>(r) * bytes, i + static_cast<size_t>(r) * bytes, bytes);
  t.wait_all();
}

void barrier(Transport& t, const wire::Call& call) {
  const int n = t.size();
  const int r = t.rank();
  // Dissemination: after round k every rank has heard, directly or not, from 2^(k+1) ranks.
  for (int k = 1; k < n; k <<= 1) {
    t.send((r + k) % n, wire::make_header(call, 0), nullptr, 0);
    t.wait(t.recv((r - k + n) % n, call, nullptr, 0));
  }
  t.wait_all();
}

}  // namespace chorus::algo
