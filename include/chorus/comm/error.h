// Exceptions thrown at chorus's API boundary.
//
// Every message carries its context: this rank, the peer (rank and address), the operation and its
// sequence number, the time waited, the system error text and, where a user mistake is likely, the
// fix. Catch chorus::Error to handle them all.
#pragma once

#include <stdexcept>
#include <string>

namespace chorus {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A deadline passed: a peer or the store did not answer in time.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer closed its connection, died, or the socket failed.
class PeerError : public Error {
 public:
  using Error::Error;
};

// Ranks called different collectives, or the same one with different arguments.
class MismatchError : public Error {
 public:
  using Error::Error;
};

// A peer or store client was refused: wrong job token, protocol version, rank or group.
class HandshakeError : public Error {
 public:
  using Error::Error;
};

// The caller passed bad arguments (bad URL, rank out of range, unsupported dtype/op ...).
class UsageError : public Error {
 public:
  using Error::Error;
};

}  // namespace chorus
