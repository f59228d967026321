// MpiTransport: setup, point-to-point, waiting with deadlines, failure notices and close; and
// connect_mpi_process_group, which initialises MPI and builds a process group over MPI_COMM_WORLD.
// The native collectives are mpi_collectives.cc. Design and limits: docs/mpi.md.
#include "mpi_transport.h"

#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "chorus/comm/error.h"
#include "chorus/comm/mpi.h"
#include "plan.h"
#include "process_group_impl.h"

namespace chorus::transport::mpi {
namespace {

using net::Clock;

constexpr size_t kMaxMessage = size_t{1} << 30;  // MPI counts are ints: payloads go in pieces of this
constexpr size_t kHostBytes = 64;                 // host names as exchanged at setup

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(text, static_cast<size_t>(len)) + " (MPI error " + std::to_string(rc) + ")";
}

}  // namespace

MpiTransport::MpiTransport(MPI_Comm comm, MpiOptions options, net::Deadline deadline)
    : comm_(comm), o_(std::move(options)) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  spin_us_ = o_.spin_us >= 0 ? o_.spin_us : plan::default_spin_us(TransportKind::kMpi, size_, std::thread::hardware_concurrency());
  sends_.resize(static_cast<size_t>(size_));
  recvs_.resize(static_cast<size_t>(size_));
  stash_.resize(static_cast<size_t>(size_));
  call_.op = wire::OpType::kNone;
  deadline_ = deadline;
  // Every rank's host and world rank, for naming peers in errors.
  struct Who {
    int32_t world_rank;
    char host[kHostBytes];
  } mine{}, *all = nullptr;
  MPI_Comm_rank(MPI_COMM_WORLD, &mine.world_rank);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::memcpy(mine.host, name, std::min<size_t>(static_cast<size_t>(std::max(len, 0)), kHostBytes - 1));
  std::vector<Who> who(static_cast<size_t>(size_));
  all = who.data();
  MPI_Request req;
  check(MPI_Iallgather(&mine, sizeof(Who), MPI_BYTE, all, sizeof(Who), MPI_BYTE, comm_, &req), "group setup (MPI_Iallgather)");
  wait_request(&req, "group setup: the exchange of host names");
  for (const Who& w : who) {
    world_ranks_.push_back(w.world_rank);
    hosts_.emplace_back(w.host, strnlen(w.host, kHostBytes));
  }
}

std::string MpiTransport::peer_name(int peer) const {
  if (peer < 0 || peer >= size_ || hosts_.empty()) return "rank " + std::to_string(peer);
  const size_t p = static_cast<size_t>(peer);
  std::string s = "rank " + std::to_string(peer) + " (" + hosts_[p];
  if (world_ranks_[p] != peer) s += ", MPI_COMM_WORLD rank " + std::to_string(world_ranks_[p]);
  return s + ")";
}

void MpiTransport::check(int rc, const std::string& what) const {
  if (rc != MPI_SUCCESS) throw PeerError(prefix() + ": " + what + " failed: " + mpi_error_text(rc));
}

void MpiTransport::begin(const wire::Call& call, net::Deadline deadline) {
  if (aborted_ || closed_) throw UsageError(prefix() + ": the MPI transport is " + (closed_ ? "closed" : "broken"));
  call_ = call;
  deadline_ = deadline;
  start_ = Clock::now();
}

void MpiTransport::post_payload(Op& op, char* data, size_t n, bool send) {
  // At least one message, empty ones too: the pair of header and payload stays in step.
  size_t off = 0;
  do {
    const size_t k = std::min(n - off, kMaxMessage);
    MPI_Request r;
    if (send) {
      check(MPI_Isend(data + off, static_cast<int>(k), MPI_BYTE, op.peer, kDataTag, comm_, &r),
            "MPI_Isend to " + peer_name(op.peer));
    } else {
      check(MPI_Irecv(data + off, static_cast<int>(k), MPI_BYTE, op.peer, kDataTag, comm_, &r),
            "MPI_Irecv from " + peer_name(op.peer));
    }
    op.reqs.push_back(r);
    off += k;
  } while (off < n);
}

Ticket MpiTransport::send(int peer, const wire::Header& header, const void* data, size_t n) {
  auto& q = sends_[static_cast<size_t>(peer)];
  q.emplace_back();
  Op& op = q.back();  // deque: its address stays while MPI reads the header from it
  op.ticket = next_++;
  op.peer = peer;
  op.is_send = true;
  op.header = header;
  MPI_Request r;
  check(MPI_Isend(&op.header, sizeof(wire::Header), MPI_BYTE, peer, kDataTag, comm_, &r),
        "MPI_Isend to " + peer_name(peer));
  op.reqs.push_back(r);
  post_payload(op, static_cast<char*>(const_cast<void*>(data)), n, true);
  pending_.insert(op.ticket);
  ++pending_sends_;
  return op.ticket;
}

Ticket MpiTransport::recv(int peer, const wire::Call& expect, void* data, size_t n) {
  auto& q = recvs_[static_cast<size_t>(peer)];
  // Messages read ahead come first; while one is waited for, later receives queue behind it.
  const bool behind = !stash_[static_cast<size_t>(peer)].empty() ||
                      std::any_of(q.begin(), q.end(), [](const Op& o) { return o.from_stash; });
  q.emplace_back();
  Op& op = q.back();
  op.ticket = next_++;
  op.peer = peer;
  op.expect = expect;
  op.data = static_cast<char*>(data);
  op.n = n;
  op.from_stash = behind;
  if (!behind) {
    MPI_Request r;
    check(MPI_Irecv(&op.header, sizeof(wire::Header), MPI_BYTE, peer, kDataTag, comm_, &r),
          "MPI_Irecv from " + peer_name(peer));
    op.reqs.push_back(r);
    post_payload(op, op.data, n, false);
  }
  pending_.insert(op.ticket);
  return op.ticket;
}

void MpiTransport::check_header(const Op& op, const wire::Header& h) const {
  if (h.magic != wire::kMessageMagic || h.kind != wire::Kind::kData) {
    throw PeerError(prefix() + ": received a corrupt message header from " + peer_name(op.peer));
  }
  if (!wire::same_call(h, op.expect)) {
    throw MismatchError(wire::mismatch_message(me(), op.expect, peer_name(op.peer), "called " + wire::describe(h)));
  }
  if (h.payload != op.n) {
    throw MismatchError(prefix() + ": " + peer_name(op.peer) + " sent " + std::to_string(h.payload) +
                        " bytes where this rank expected " + std::to_string(op.n) +
                        "; the ranks disagree about per-rank sizes");
  }
}

bool MpiTransport::pump_recv(Op& op) {
  if (op.from_stash) {
    auto& st = stash_[static_cast<size_t>(op.peer)];
    if (st.empty()) return false;
    Stashed& s = st.front();
    if (!op.header_checked) {
      check_header(op, s.header);
      op.header_checked = true;
    }
    int done = 1;
    if (!s.reqs.empty()) {
      check(MPI_Testall(static_cast<int>(s.reqs.size()), s.reqs.data(), &done, MPI_STATUSES_IGNORE),
            "receiving from " + peer_name(op.peer));
    }
    if (!done) return false;
    if (op.n > 0) std::memcpy(op.data, s.payload.data(), op.n);
    st.pop_front();
    return true;
  }
  if (!op.header_checked) {
    // The header first: a mismatch is reported before the payload's receive could misread anything.
    int got = 0;
    check(MPI_Test(&op.reqs[0], &got, MPI_STATUS_IGNORE), "receiving from " + peer_name(op.peer));
    if (!got) return false;
    check_header(op, op.header);
    op.header_checked = true;
  }
  int done = 0;
  check(MPI_Testall(static_cast<int>(op.reqs.size() - 1), op.reqs.data() + 1, &done, MPI_STATUSES_IGNORE),
        "receiving from " + peer_name(op.peer));
  return done != 0;
}

// A peer's next message, received while this rank has not posted its receive, into a buffer of
// this transport's own (so that a peer blocked in a send to this rank gets going).
void MpiTransport::read_ahead(int peer) {
  int flag = 0;
  MPI_Status st;
  check(MPI_Iprobe(peer, kDataTag, comm_, &flag, &st), "MPI_Iprobe");
  if (!flag) return;
  auto& q = stash_[static_cast<size_t>(peer)];
  if (!q.empty() && !q.back().reqs.empty()) return;  // a payload is still arriving: it comes first
  q.emplace_back();
  Stashed& s = q.back();
  check(MPI_Recv(&s.header, sizeof(wire::Header), MPI_BYTE, peer, kDataTag, comm_, MPI_STATUS_IGNORE),
        "MPI_Recv from " + peer_name(peer));
  if (s.header.magic != wire::kMessageMagic) throw PeerError(prefix() + ": corrupt message from " + peer_name(peer));
  s.payload.resize(s.header.payload);
  size_t off = 0;
  do {
    const size_t k = std::min<size_t>(s.payload.size() - off, kMaxMessage);
    MPI_Request r;
    check(MPI_Irecv(s.payload.data() + off, static_cast<int>(k), MPI_BYTE, peer, kDataTag, comm_, &r),
          "MPI_Irecv from " + peer_name(peer));
    s.reqs.push_back(r);
    off += k;
  } while (off < s.payload.size());
}

bool MpiTransport::pump() {
  bool progressed = false;
  for (int p = 0; p < size_; ++p) {
    auto& rq = recvs_[static_cast<size_t>(p)];
    // Receives complete in order (their messages arrive in order).
    while (!rq.empty() && pump_recv(rq.front())) {
      pending_.erase(rq.front().ticket);
      rq.pop_front();
      progressed = true;
    }
    auto& sq = sends_[static_cast<size_t>(p)];
    while (!sq.empty()) {
      Op& op = sq.front();
      int done = 0;
      check(MPI_Testall(static_cast<int>(op.reqs.size()), op.reqs.data(), &done, MPI_STATUSES_IGNORE),
            "sending to " + peer_name(p));
      if (!done) break;
      pending_.erase(op.ticket);
      --pending_sends_;
      sq.pop_front();
      progressed = true;
    }
    // Both ranks may send before they receive: take what this peer sends meanwhile.
    if (pending_sends_ > 0 && rq.empty() && p != rank_) read_ahead(p);
  }
  // A payload read ahead may still be arriving: keep it moving.
  for (auto& q : stash_) {
    for (Stashed& s : q) {
      if (s.reqs.empty()) continue;
      int done = 0;
      check(MPI_Testall(static_cast<int>(s.reqs.size()), s.reqs.data(), &done, MPI_STATUSES_IGNORE), "reading ahead");
      if (done) s.reqs.clear();
    }
  }
  return progressed;
}

// A rank that failed sent every peer [error class][text] on kAbortTag: raise its error here.
void MpiTransport::check_abort_notice() {
  int flag = 0;
  MPI_Status st;
  if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortTag, comm_, &flag, &st) != MPI_SUCCESS || !flag) return;
  int n = 0;
  MPI_Get_count(&st, MPI_BYTE, &n);
  std::string text(static_cast<size_t>(std::max(n, 1)), '\0');
  MPI_Recv(text.data(), n, MPI_BYTE, st.MPI_SOURCE, kAbortTag, comm_, MPI_STATUS_IGNORE);
  const uint8_t cls = static_cast<uint8_t>(text[0]);
  throw_error(cls, prefix() + ": failed because " + peer_name(st.MPI_SOURCE) + " failed: " + text.substr(1));
}

void MpiTransport::wait_until(const std::function<bool()>& done, const std::function<std::string()>& what) {
  const auto begin = Clock::now();
  auto nap = std::chrono::microseconds(5);
  for (uint64_t i = 0;; ++i) {
    if (done()) return;
    check_abort_notice();
    const auto now = Clock::now();
    if (now >= deadline_) fail_timeout(what());
    // Spin while a thread waits on the group and the ranks have cores of their own; yield when
    // they share cores (the peer needs this one); nap while the caller computes (DDP's backward),
    // whose core this is. MPI progresses only inside MPI_Test, so naps stay short.
    const bool gate_open = gate_ == nullptr || gate_->load(std::memory_order_relaxed) > 0;
    if (gate_open && now - begin < std::chrono::microseconds(spin_us_)) continue;
    if (gate_open) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(100));
    }
  }
}

void MpiTransport::wait_request(MPI_Request* req, const char* what) {
  wait_until(
      [&] {
        int flag = 0;
        check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), what);
        return flag != 0;
      },
      [&] {
        return std::string(what) + " to complete on all " + std::to_string(size_) +
               " ranks (MPI does not say which rank it waits for; every rank must make this call)";
      });
}

void MpiTransport::wait(Ticket ticket) {
  wait_until([&] {
    pump();
    return pending_.count(ticket) == 0;
  }, [&] { return awaited(); });
}

void MpiTransport::wait_all() {
  wait_until([&] {
    pump();
    return pending_.empty();
  }, [&] { return awaited(); });
}

std::string MpiTransport::awaited() const {
  std::ostringstream out;
  const char* sep = "";
  for (int p = 0; p < size_; ++p) {
    if (!recvs_[static_cast<size_t>(p)].empty()) {
      out << sep << peer_name(p) << " to send its next message";
      sep = "; and for ";
    } else if (!sends_[static_cast<size_t>(p)].empty()) {
      out << sep << peer_name(p) << " to receive " << sends_[static_cast<size_t>(p)].front().header.payload
          << " bytes (it has not posted the matching receive)";
      sep = "; and for ";
    }
  }
  return out.str();
}

void MpiTransport::fail_timeout(const std::string& what) {
  throw TimeoutError(prefix() + ": timed out after " + net::format_duration(Clock::now() - start_) + " waiting for " +
                     what + ". The peer may be stuck or slower, or may be calling a different collective; if it "
                     "is legitimately slow, raise the timeout in the group's Options");
}

void MpiTransport::abort(const std::string& reason, uint8_t error_class) {
  if (aborted_ || closed_) return;
  aborted_ = true;
  std::string msg(1, static_cast<char>(error_class));
  msg += reason.substr(0, 4000);
  std::vector<MPI_Request> reqs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    MPI_Request r;
    if (MPI_Isend(msg.data(), static_cast<int>(msg.size()), MPI_BYTE, p, kAbortTag, comm_, &r) == MPI_SUCCESS) {
      reqs.push_back(r);
    }
  }
  // Small messages leave at once (eager); give a slow link a moment, then let MPI finish alone.
  const auto until = Clock::now() + std::chrono::milliseconds(200);
  int done = 0;
  while (!reqs.empty() && Clock::now() < until) {
    MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
    if (done) break;
    sched_yield();
  }
  if (!done) {
    for (auto& r : reqs) {
      if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    }
  }
}

void MpiTransport::close() {
  if (closed_) return;
  closed_ = true;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // at exit, after MPI_Finalize: nothing left to free
  // After a failure, operations may still be posted: their receives are cancelled, their sends left
  // to MPI; the communicator stays (freeing it with requests pending could wait for peers).
  bool clean = !aborted_;
  for (auto* queues : {&recvs_, &sends_}) {
    for (auto& q : *queues) {
      for (Op& op : q) {
        for (MPI_Request& r : op.reqs) {
          if (r == MPI_REQUEST_NULL) continue;
          if (!op.is_send) MPI_Cancel(&r);
          MPI_Request_free(&r);
          clean = false;
        }
      }
      q.clear();
    }
  }
  for (auto& q : stash_) {
    for (Stashed& s : q) {
      for (MPI_Request& r : s.reqs) {
        MPI_Cancel(&r);
        MPI_Request_free(&r);
        clean = false;
      }
    }
    q.clear();
  }
  if (clean) MPI_Comm_free(&comm_);
}

std::unique_ptr<Transport> MpiTransport::subgroup(const std::vector<int>& ranks, const std::string& group_name) {
  int color = MPI_UNDEFINED, key = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] == rank_) {
      color = 0;
      key = static_cast<int>(i);
    }
  }
  MPI_Comm sub = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color, key, &sub), "new_group (MPI_Comm_split)");
  if (sub == MPI_COMM_NULL) return nullptr;
  MpiOptions o = o_;
  o.group_name = group_name;
  return std::make_unique<MpiTransport>(sub, o, deadline_);
}

}  // namespace chorus::transport::mpi

namespace chorus {
namespace {

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// MPI is once per process: initialised by the first group unless the program did it.
void ensure_mpi() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  int initialized = 0, finalized = 0, provided = MPI_THREAD_SINGLE;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) throw UsageError("chorus: connect_mpi_process_group: MPI was already finalised in this process");
  if (!initialized) {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      throw UsageError("chorus: MPI_Init_thread failed: " + transport::mpi::mpi_error_text(rc) +
                       "; start the ranks with mpirun");
    }
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    throw UsageError("chorus: the MPI backend needs MPI_THREAD_MULTIPLE (every process group runs its operations "
                     "on a thread of its own) but this MPI gives level " + std::to_string(provided) +
                     (initialized ? "; initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...), or let "
                                    "chorus initialise it"
                                  : "; use an MPI built with thread support (Debian's Open MPI has it)"));
  }
}

}  // namespace

bool mpi_available() { return true; }

std::shared_ptr<ProcessGroup> connect_mpi_process_group(ProcessGroupOptions options) {
  ensure_mpi();
  options.transport = "mpi";
  transport::mpi::MpiOptions o;
  o.group_name = options.group_name;
  o.spin_us = options.spin_us;
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);  // the group's own message space
  auto t = std::make_unique<transport::mpi::MpiTransport>(comm, o, net::deadline_after(options.timeout));
  return ProcessGroup::Impl::adopt(std::move(t), nullptr, std::move(options));
}

}  // namespace chorus
