#include "chorus/comm/types.h"

#include <cstring>
#include <string>

#include "chorus/comm/check.h"

#include "chorus/comm/error.h"

namespace chorus {

size_t element_size(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  throw UsageError("unknown chorus::DataType " + std::to_string(static_cast<int>(dtype)));
}

const char* to_string(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
  }
  return "unknown-dtype";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "unknown-op";
}

DataType parse_data_type(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "float") return DataType::kFloat32;
  if (name == "f64" || name == "float64" || name == "double") return DataType::kFloat64;
  if (name == "f16" || name == "float16" || name == "half") return DataType::kFloat16;
  if (name == "bf16" || name == "bfloat16") return DataType::kBFloat16;
  if (name == "i8" || name == "int8") return DataType::kInt8;
  if (name == "u8" || name == "uint8") return DataType::kUInt8;
  if (name == "i32" || name == "int32" || name == "int") return DataType::kInt32;
  if (name == "i64" || name == "int64" || name == "long") return DataType::kInt64;
  throw UsageError("unknown dtype '" + name +
                   "'; expected one of f32, f64, f16, bf16, i8, u8, i32, i64");
}

bool parse_transport(const std::string& name, TransportKind* kind) {
  for (TransportKind k : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kShm, TransportKind::kHybrid,
                          TransportKind::kMpi}) {
    if (name == to_string(k)) {
      *kind = k;
      return true;
    }
  }
  return false;
}

const char* to_string(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto: return "auto";
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kShm: return "shm";
    case TransportKind::kHybrid: return "hybrid";
    case TransportKind::kMpi: return "mpi";
  }
  return "?";
}

bool parse_allreduce_algorithm(const std::string& name, AllreduceAlgorithm* algorithm) {
  for (AllreduceAlgorithm a : {AllreduceAlgorithm::kAuto, AllreduceAlgorithm::kRing, AllreduceAlgorithm::kRecursiveDoubling,
                               AllreduceAlgorithm::kRabenseifner, AllreduceAlgorithm::kTuned}) {
    if (name == to_string(a)) {
      *algorithm = a;
      return true;
    }
  }
  return false;
}

const char* to_string(AllreduceAlgorithm algorithm) {
  switch (algorithm) {
    case AllreduceAlgorithm::kAuto: return "auto";
    case AllreduceAlgorithm::kRing: return "ring";
    case AllreduceAlgorithm::kRecursiveDoubling: return "recursive_doubling";
    case AllreduceAlgorithm::kRabenseifner: return "rabenseifner";
    case AllreduceAlgorithm::kTuned: return "tuned";
  }
  return "?";
}

}  // namespace chorus

namespace chorus::detail {

void check_failed(const char* file, int line, const char* condition, const std::string& what) {
  const char* name = std::strrchr(file, '/');
  throw Error(std::string("chorus internal error at ") + (name != nullptr ? name + 1 : file) + ":" +
              std::to_string(line) + ": " + condition + " (" + what +
              "); this is a bug in chorus, please report it with this line");
}

}  // namespace chorus::detail
