// Internal: the one mapping between chorus's exception types and the byte that carries them on
// the wire (TCP abort messages, a shared-memory segment's header), so that a peer rethrows the
// type the failing rank raised, over every transport.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

namespace chorus::transport {

// Error classes carried by abort messages. Values are wire format: append, never renumber.
enum ErrorClass : uint8_t {
  kErrOther = 0,  // chorus::Error or anything else
  kErrTimeout = 1,
  kErrPeer = 2,
  kErrMismatch = 3,
  kErrHandshake = 4,
  kErrUsage = 5,
};

// The class of `e`: its most derived chorus error type, kErrOther for anything else.
uint8_t error_class_of(const std::exception& e);

// The exception of class `error_class` with `message` (chorus::Error for kErrOther and for a value
// this build does not know, so a newer peer's class degrades to the base type).
std::exception_ptr make_error(uint8_t error_class, const std::string& message);
[[noreturn]] void throw_error(uint8_t error_class, const std::string& message);

// Marks an error whose message already begins with this rank ("chorus: rank N: ..."), thrown
// where the rank is at hand, so that code adding the rank to errors passing through it (the
// process group's setup) adds it once. A flag on the type, not a match on the text: a peer's
// message relayed here names the peer's rank and is rebuilt by make_error without the mark.
class NamesRank {
 public:
  virtual ~NamesRank() = default;
};

// `E` (a chorus error type) marked NamesRank; catch sites see an `E`.
template <class E>
class Ranked : public E, public NamesRank {
 public:
  using E::E;
};

inline bool names_rank(const std::exception& e) { return dynamic_cast<const NamesRank*>(&e) != nullptr; }

// throw_error's exception marked Ranked: for a `message` that already begins with this rank.
[[noreturn]] void throw_ranked_error(uint8_t error_class, const std::string& message);

}  // namespace chorus::transport
