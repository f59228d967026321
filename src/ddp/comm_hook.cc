// The built-in communication hooks (allreduce, fp16/bf16 compression) and GradBucket's helpers.
// See include/chorus/ddp/comm_hook.h for the contract.
#include "chorus/ddp/comm_hook.h"

#include <ATen/ATen.h>

#include "chorus/comm/error.h"
#include "chorus/torch/distributed.h"
#include "hook_thread.h"

namespace chorus::ddp {

std::vector<at::Tensor> GradBucket::gradients() const {
  std::vector<at::Tensor> out;
  out.reserve(parameters.size());
  for (size_t k = 0; k < parameters.size(); ++k) {
    const int64_t n = c10::multiply_integers(shapes[k]);
    out.push_back(buffer.narrow(0, offsets[k], n).view(shapes[k]));
  }
  return out;
}

std::shared_ptr<Work> GradBucket::run_async(std::function<void()> fn) const {
  if (thread_ == nullptr) throw UsageError("chorus::ddp: GradBucket::run_async on a bucket no reducer made");
  return thread_->submit(std::move(fn));
}

namespace {

std::shared_ptr<Work> allreduce_average(GradBucket& bucket) {
  if (bucket.divisor == bucket.group->size()) {
    return dist::all_reduce(bucket.buffer, ReduceOp::kAvg, bucket.group, /*async_op=*/true);
  }
  bucket.buffer.div_(bucket.divisor);  // join with divide_by_initial_world_size = false
  return dist::all_reduce(bucket.buffer, ReduceOp::kSum, bucket.group, /*async_op=*/true);
}

class AllreduceHook final : public CommHook {
 public:
  std::string describe() const override { return "allreduce_hook"; }
  std::shared_ptr<Work> run(GradBucket& bucket) override { return allreduce_average(bucket); }
};

// Casts to `wire_type` around the allreduce. The wire buffers come from the group's
// allocate_buffer, so over shared memory the allreduce works in place across the ranks.
class CompressHook final : public CommHook {
 public:
  CompressHook(std::string name, at::ScalarType wire_type) : name_(std::move(name)), wire_type_(wire_type) {}
  std::string describe() const override { return name_; }

  void prepare(const std::vector<GradBucket>& buckets, HookMemory& memory) override {
    wire_.assign(buckets.size(), at::Tensor());
    for (size_t b = 0; b < buckets.size(); ++b) {
      const at::Tensor& flat = buckets[b].buffer;
      const auto type = flat.scalar_type();
      if (!at::isFloatingType(type) || type == at::kHalf || type == at::kBFloat16) continue;
      const int64_t n = flat.numel();
      if (flat.is_cuda()) {  // on the device, next to the bucket; staged like it
        wire_[b] = at::empty({n}, flat.options().dtype(wire_type_).requires_grad(false));
        memory.bytes += static_cast<int64_t>(wire_[b].nbytes());
        continue;
      }
      std::shared_ptr<Buffer> buf = buckets[b].group->allocate_buffer(static_cast<size_t>(n) * c10::elementSize(wire_type_));
      memory.bytes += static_cast<int64_t>(buf->size());
      if (buf->shared()) memory.shared_bytes += static_cast<int64_t>(buf->size());
      void* data = buf->data();
      wire_[b] = at::from_blob(data, {n}, [buf](void*) mutable { buf.reset(); },
                               flat.options().dtype(wire_type_).requires_grad(false));
    }
  }

  std::shared_ptr<Work> run(GradBucket& bucket) override {
    if (bucket.index >= wire_.size() || !wire_[bucket.index].defined()) return allreduce_average(bucket);
    at::Tensor wire = wire_[bucket.index];
    at::Tensor flat = bucket.buffer;
    // Divide first, in full precision, so the float16 sum cannot overflow where the average fits.
    flat.div_(bucket.divisor);
    wire.copy_(flat);
    return dist::then(dist::all_reduce(wire, ReduceOp::kSum, bucket.group, /*async_op=*/true),
                      [flat, wire]() mutable { flat.copy_(wire); });
  }

 private:
  std::string name_;
  at::ScalarType wire_type_;
  std::vector<at::Tensor> wire_;  // per bucket; undefined where the bucket travels as it is
};

}  // namespace

std::shared_ptr<CommHook> allreduce_hook() { return std::make_shared<AllreduceHook>(); }
std::shared_ptr<CommHook> fp16_compress_hook() { return std::make_shared<CompressHook>("fp16_compress_hook", at::kHalf); }
std::shared_ptr<CommHook> bf16_compress_hook() {
  return std::make_shared<CompressHook>("bf16_compress_hook", at::kBFloat16);
}

}  // namespace chorus::ddp
