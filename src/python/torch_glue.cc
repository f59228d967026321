// The backend's parts that are not the group itself (torch_glue.h).
#include "torch_glue.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include "chorus/comm/random.h"
#include "chorus/comm/tcp_store.h"

namespace chorus::python::detail {
namespace {

// The address of the interface this host would use to reach `host` (a UDP socket "connected" to
// it sends nothing); "" if it does not resolve.
std::string address_toward(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  std::string out;
  const int fd = ::socket(found->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* a = local.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                                                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
    if (::inet_ntop(local.ss_family, a, text, sizeof(text)) != nullptr) out = text;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return out;
}

}  // namespace

DataType data_type(const at::Tensor& t, const char* op, bool reduces) {
  switch (t.scalar_type()) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool:
      if (!reduces) return DataType::kUInt8;
      throw UsageError(std::string("chorus backend: ") + op + ": bool tensors cannot be reduced by chorus yet; "
                       "convert with .to(torch.uint8) (MAX/MIN as OR/AND)");
    default: break;
  }
  throw UsageError(std::string("chorus backend: ") + op + ": dtype " + c10::toString(t.scalar_type()) +
                   " is not supported; use float32/64, float16, bfloat16, int8, uint8, int32, int64 or bool");
}

ReduceOp reduce_op(const ::c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case ::c10d::ReduceOp::SUM: return ReduceOp::kSum;
    case ::c10d::ReduceOp::AVG: return ReduceOp::kAvg;
    case ::c10d::ReduceOp::PRODUCT: return ReduceOp::kProd;
    case ::c10d::ReduceOp::MIN: return ReduceOp::kMin;
    case ::c10d::ReduceOp::MAX: return ReduceOp::kMax;
    default: break;
  }
  throw UsageError(std::string("chorus backend: ") + name +
                   ": this reduce op is not supported here; SUM, AVG, PRODUCT, MIN and MAX are everywhere, and "
                   "BAND, BOR and BXOR in all_reduce and reduce (PREMUL_SUM is NCCL's alone)");
}

bool bitwise(const ::c10d::ReduceOp& op) {
  return op.op_ == ::c10d::ReduceOp::BAND || op.op_ == ::c10d::ReduceOp::BOR || op.op_ == ::c10d::ReduceOp::BXOR;
}

void check_tensor(const at::Tensor& t, const char* op) {
  if (!t.defined()) throw UsageError(std::string("chorus backend: ") + op + ": undefined tensor");
  if (t.layout() != at::kStrided) throw UsageError(std::string("chorus backend: ") + op + ": sparse tensors are not supported; call .to_dense()");
  if (!t.device().is_cpu()) {
    throw UsageError(std::string("chorus backend: ") + op + ": tensor on " + t.device().str() +
                     "; chorus's Python backend takes CPU tensors so far (the C++ API stages CUDA tensors: "
                     "docs/gpu.md); copy with .cpu()");
  }
  if (!t.is_contiguous()) throw UsageError(std::string("chorus backend: ") + op + ": tensor is not contiguous; call .contiguous()");
}

const at::Tensor& single(const std::vector<at::Tensor>& tensors, const char* op) {
  if (tensors.size() != 1) {
    throw UsageError(std::string("chorus backend: ") + op + ": takes one tensor per call (got " +
                     std::to_string(tensors.size()) + "), as gloo does for CPU tensors");
  }
  check_tensor(tensors[0], op);
  return tensors[0];
}

void Completions::complete(Pending& p) {
  std::exception_ptr error;
  try {
    for (auto& w : p.inner) w->wait();
    if (p.finish) p.finish();
  } catch (const std::exception& e) {
    error = std::make_exception_ptr(std::runtime_error(e.what()));
  } catch (...) {
    error = std::current_exception();
  }
  p.keep.clear();
  p.work->complete(error);
}

std::shared_ptr<Store> authenticated_store(const std::shared_ptr<Store>& torch_store, int rank,
                                           const std::string& token, std::chrono::milliseconds timeout,
                                           std::string* local_address) {
  const char* host = std::getenv("CHORUS_STORE_ADDR");
  const char* port = std::getenv("CHORUS_STORE_PORT");
  if (host == nullptr || *host == '\0' || port == nullptr || *port == '\0') return torch_store;
  const std::string key = "chorus/python/group";
  if (rank == 0) torch_store->set(key, random_token().substr(0, 16));
  torch_store->wait({key}, timeout);
  TcpStoreOptions so;
  so.host = host;
  try {
    so.port = std::stoi(port);
  } catch (const std::exception&) {
    throw UsageError(std::string("chorus backend: CHORUS_STORE_PORT='") + port + "' is not a port number");
  }
  so.token = token;
  so.timeout = timeout;
  auto client = std::make_shared<TcpStore>(so);
  *local_address = client->local_address();  // the interface that reaches the launcher's store
  return std::make_shared<PrefixStore>("python/" + torch_store->get(key) + "/", client);
}

std::string advertise_host(const std::string& toward_store) {
  if (const char* a = std::getenv("CHORUS_ADVERTISE_HOST"); a != nullptr && *a != '\0') return a;
  if (!toward_store.empty()) return toward_store;
  if (const char* m = std::getenv("MASTER_ADDR"); m != nullptr && *m != '\0') return address_toward(m);
  return "";
}

}  // namespace chorus::python::detail
