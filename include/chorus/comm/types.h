// Element types and reduction operators understood by the collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace chorus {

enum class DataType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,   // IEEE half; reduced in float32
  kBFloat16 = 3,  // bfloat16; reduced in float32
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
};
constexpr int kNumDataTypes = 8;

// kAvg divides the sum by the group size; for integer types the quotient is truncated toward zero.
enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kProd = 2,
  kMin = 3,
  kMax = 4,
};
constexpr int kNumReduceOps = 5;

size_t element_size(DataType dtype);
const char* to_string(DataType dtype);
const char* to_string(ReduceOp op);
// Parses "f32", "float32", "bf16", ... ; throws UsageError on an unknown name.
DataType parse_data_type(const std::string& name);

// The transports a process group can run over (ProcessGroupOptions::transport names one; docs/shm.md).
enum class TransportKind : uint8_t {
  kAuto,    // shm, hybrid or tcp, from where the ranks are (plan::choose_auto_transport)
  kTcp,
  kShm,
  kHybrid,
  kMpi,     // Open MPI under mpirun (connect_mpi_process_group; not a ProcessGroupOptions value)
};
// "auto", "tcp", "shm", "hybrid" or "mpi" to its kind; false for any other name. The one parser
// of transport names (options, backend names, CHORUS_TRANSPORT, command lines).
bool parse_transport(const std::string& name, TransportKind* kind);
// The name parse_transport reads.
const char* to_string(TransportKind kind);

// How allreduce moves the data (ProcessGroupOptions::allreduce_algorithm; docs/algorithms.md).
enum class AllreduceAlgorithm : uint8_t {
  kAuto,               // per call, the fastest by the link model (plan::choose_allreduce)
  kRing,               // reduce-scatter then allgather around a ring, pipelined in segments
  kRecursiveDoubling,  // log2(W) exchanges of the whole buffer
  kRabenseifner,       // reduce-scatter by recursive halving, allgather by recursive doubling
  kTuned,              // per size class, the fastest as measured by trials of each (docs/algorithms.md)
};
// The most calls of one size class that kTuned spends on trials (a benchmark that warms up this
// many calls per size times only the chosen algorithm).
constexpr int kTunedAllreduceTrials = 18;
// "auto", "ring", "recursive_doubling", "rabenseifner" or "tuned"; false for any other name.
bool parse_allreduce_algorithm(const std::string& name, AllreduceAlgorithm* algorithm);
const char* to_string(AllreduceAlgorithm algorithm);

}  // namespace chorus
