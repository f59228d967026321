#include "error_class.h"

#include "chorus/comm/error.h"

namespace chorus::transport {

uint8_t error_class_of(const std::exception& e) {
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr) return kErrTimeout;
  if (dynamic_cast<const PeerError*>(&e) != nullptr) return kErrPeer;
  if (dynamic_cast<const MismatchError*>(&e) != nullptr) return kErrMismatch;
  if (dynamic_cast<const HandshakeError*>(&e) != nullptr) return kErrHandshake;
  if (dynamic_cast<const UsageError*>(&e) != nullptr) return kErrUsage;
  return kErrOther;
}

std::exception_ptr make_error(uint8_t error_class, const std::string& message) {
  try {
    throw_error(error_class, message);
  } catch (...) {
    return std::current_exception();
  }
}

void throw_error(uint8_t error_class, const std::string& message) {
  switch (error_class) {
    case kErrTimeout: throw TimeoutError(message);
    case kErrPeer: throw PeerError(message);
    case kErrMismatch: throw MismatchError(message);
    case kErrHandshake: throw HandshakeError(message);
    case kErrUsage: throw UsageError(message);
    default: throw Error(message);
  }
}

void throw_ranked_error(uint8_t error_class, const std::string& message) {
  switch (error_class) {
    case kErrTimeout: throw Ranked<TimeoutError>(message);
    case kErrPeer: throw Ranked<PeerError>(message);
    case kErrMismatch: throw Ranked<MismatchError>(message);
    case kErrHandshake: throw Ranked<HandshakeError>(message);
    case kErrUsage: throw Ranked<UsageError>(message);
    default: throw Ranked<Error>(message);
  }
}

}  // namespace chorus::transport
