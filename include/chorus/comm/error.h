// Exceptions thrown at chorus's API boundary.
//
// Every message carries its context: this rank, the peer (rank and address), the operation and its
// sequence number, the time waited, the system error text and, where a user mistake is likely, the
// fix. Catch chorus::Error to handle them all.
#pragma once

#include <cstddef>
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

// Bytes from outside (a file's contents, a store key) as they may appear in a message: printable
// ASCII and well-formed UTF-8 as they are, a backslash as "\\", any other byte as "\xNN"; more
// than max_shown bytes are cut, with "...(N bytes)" after. A message never carries a terminal's
// control codes or invalid UTF-8 from data.
std::string printable(const std::string& bytes, size_t max_shown = 96);

}  // namespace chorus
