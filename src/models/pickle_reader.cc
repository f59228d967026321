#include "pickle_reader.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "chorus/torch/pickle_opcodes.h"

namespace chorus::models::detail {
namespace {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kList, kDict, kGlobal, kStorage, kTensor };
  Kind kind = Kind::kNone;
  int64_t i = 0;
  double f = 0;
  std::string s;                                      // kStr; kGlobal: "module.name"
  std::vector<ValuePtr> items;                        // kTuple, kList
  std::vector<std::pair<ValuePtr, ValuePtr>> dict;    // kDict, in insertion order
  at::Storage storage;                                // kStorage
  at::ScalarType dtype = at::kFloat;                  // kStorage
  at::Tensor tensor;                                  // kTensor
};

const char* kind_name(Value::Kind k) {
  switch (k) {
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return "float";
    case Value::Kind::kStr: return "str";
    case Value::Kind::kTuple: return "tuple";
    case Value::Kind::kList: return "list";
    case Value::Kind::kDict: return "dict";
    case Value::Kind::kGlobal: return "global";
    case Value::Kind::kStorage: return "storage";
    case Value::Kind::kTensor: return "Tensor";
  }
  return "?";
}

ValuePtr make(Value::Kind kind) {
  auto v = std::make_shared<Value>();
  v->kind = kind;
  return v;
}

// torch.<Name>Storage -> dtype, as torch.save names them.
const std::map<std::string, at::ScalarType>& storage_types() {
  static const std::map<std::string, at::ScalarType> types = {
      {"torch.FloatStorage", at::kFloat},   {"torch.DoubleStorage", at::kDouble}, {"torch.HalfStorage", at::kHalf},
      {"torch.BFloat16Storage", at::kBFloat16}, {"torch.LongStorage", at::kLong}, {"torch.IntStorage", at::kInt},
      {"torch.ShortStorage", at::kShort},   {"torch.CharStorage", at::kChar},     {"torch.ByteStorage", at::kByte},
      {"torch.BoolStorage", at::kBool}};
  return types;
}

// The pickle machine for what torch.save writes for a dict of tensors (protocol 2, and the opcodes
// of protocols 3-5 that such a dict could use). Every read is bounds-checked; anything else is an
// error naming the opcode or global.
class Machine {
 public:
  Machine(const std::string& path, caffe2::serialize::PyTorchStreamReader& archive, const char* data, size_t size)
      : path_(path), archive_(archive), ops_(data, size) {}
  // A pickle can put a container inside itself (through the memo): the shared_ptr cycle would
  // never be freed (LeakSanitizer, fuzz/corpus/pickle/regression-reference-cycle.pkl). Every
  // container the machine made is emptied when it is done; the caller has taken its tensors by then.
  ~Machine() {
    for (const ValuePtr& v : containers_) {
      v->items.clear();
      v->dict.clear();
    }
  }
  Machine(const Machine&) = delete;
  Machine& operator=(const Machine&) = delete;

  ValuePtr run() {
    pickle::Op op;
    while (true) {
      try {
        if (!ops_.next(&op)) fail("truncated: no STOP");
      } catch (const pickle::FormatError& e) {
        at_ = e.offset();
        fail(std::string("truncated: the opcode ") + e.what());
      }
      at_ = op.offset;
      switch (op.code) {
        case 0x80: break;                      // PROTO
        case 0x95: break;                      // FRAME: its length is not needed
        case '.': return pop();                // STOP
        case '(': marks_.push_back(stack_.size()); break;
        case ')': push(make(Value::Kind::kTuple)); break;
        case ']': push(make(Value::Kind::kList)); break;
        case '}': push(make(Value::Kind::kDict)); break;
        case 'N': push(make(Value::Kind::kNone)); break;
        case 0x88: push(boolean(true)); break;
        case 0x89: push(boolean(false)); break;
        case 'K': case 'M': push(integer(static_cast<int64_t>(op.number))); break;  // BININT1, BININT2
        case 'J': push(integer(static_cast<int32_t>(op.number))); break;             // BININT
        case 0x8a: push(integer(long1(op.bytes))); break;
        case 'G': push(binfloat(op.bytes)); break;
        case 'X': case 0x8c: case 0x8d: push(string(op.bytes)); break;  // BINUNICODE, SHORT_, 8
        case 't': push(tuple(pop_mark())); break;
        case 0x85: push(tuple(pop_n(1))); break;
        case 0x86: push(tuple(pop_n(2))); break;
        case 0x87: push(tuple(pop_n(3))); break;
        case 'q': case 'r': memo_[op.number] = top(); break;  // BINPUT, LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;          // MEMOIZE
        case 'h': case 'j': push(memo(op.number)); break;       // BINGET, LONG_BINGET
        case 'c': push(global(std::string(op.bytes) + "." + std::string(op.second_line))); break;
        case 0x93: {  // STACK_GLOBAL
          ValuePtr name = pop(), module = pop();
          push(global(module->s + "." + name->s));
        } break;
        case 'a': {
          ValuePtr item = pop();
          append(top(), {item});
        } break;
        case 'e': {
          auto items = pop_mark();
          append(top(), items);
        } break;
        case 's': {
          ValuePtr v = pop(), k = pop();
          set_items(top(), {k, v});
        } break;
        case 'u': {
          auto items = pop_mark();
          set_items(top(), items);
        } break;
        case 'R': {
          ValuePtr args = pop(), callable = pop();
          push(reduce(*callable, *args));
        } break;
        case 'b': {
          ValuePtr state = pop();
          build(state, top());
        } break;
        case 'Q': push(persistent(pop())); break;
        default: fail("unsupported pickle opcode 0x" + hex(op.code));
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw StateDictError("read_state_dict: " + path_ + ": data.pkl at byte " + std::to_string(at_) + ": " + what +
                         " (expected what torch.save writes for a dict of tensors)");
  }
  static std::string hex(uint8_t b) {
    const char* digits = "0123456789abcdef";
    return std::string{digits[b >> 4], digits[b & 15]};
  }
  int64_t long1(std::string_view bytes) {
    const size_t n = bytes.size();
    if (n > 8) fail("integer wider than 64 bits");
    if (n == 0) return 0;
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = (v << 8) | static_cast<uint8_t>(bytes[k]);
    if (n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    return static_cast<int64_t>(v);
  }
  static ValuePtr binfloat(std::string_view bytes) {
    uint64_t bits = 0;
    for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(bytes[k]);  // big-endian
    auto v = make(Value::Kind::kFloat);
    std::memcpy(&v->f, &bits, sizeof bits);
    return v;
  }
  static ValuePtr string(std::string_view bytes) {
    auto v = make(Value::Kind::kStr);
    v->s.assign(bytes);
    return v;
  }
  static ValuePtr boolean(bool b) {
    auto v = make(Value::Kind::kBool);
    v->i = b;
    return v;
  }
  static ValuePtr integer(int64_t i) {
    auto v = make(Value::Kind::kInt);
    v->i = i;
    return v;
  }
  static ValuePtr tuple(std::vector<ValuePtr> items) {
    auto v = make(Value::Kind::kTuple);
    v->items = std::move(items);
    return v;
  }
  ValuePtr global(const std::string& name) {
    auto v = make(Value::Kind::kGlobal);
    v->s = name;
    return v;
  }
  ValuePtr memo(uint64_t id) {
    auto it = memo_.find(id);
    if (it == memo_.end()) fail("memo entry " + std::to_string(id) + " read before written");
    return it->second;
  }

  void push(ValuePtr v) {
    // Every value the machine makes is pushed: containers are recorded here, for ~Machine.
    if (v->kind == Value::Kind::kTuple || v->kind == Value::Kind::kList || v->kind == Value::Kind::kDict) {
      containers_.push_back(v);
    }
    stack_.push_back(std::move(v));
  }
  ValuePtr top() {
    if (stack_.empty()) fail("stack empty");
    return stack_.back();
  }
  ValuePtr pop() {
    ValuePtr v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<ValuePtr> pop_n(size_t n) {
    if (stack_.size() < n) fail("stack holds fewer than " + std::to_string(n) + " items");
    std::vector<ValuePtr> out(stack_.end() - static_cast<long>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return out;
  }
  std::vector<ValuePtr> pop_mark() {
    if (marks_.empty()) fail("no mark");
    const size_t start = marks_.back();
    marks_.pop_back();
    return pop_n(stack_.size() - start);
  }

  void append(const ValuePtr& list, const std::vector<ValuePtr>& items) {
    if (list->kind != Value::Kind::kList) fail("append to a " + std::string(kind_name(list->kind)));
    list->items.insert(list->items.end(), items.begin(), items.end());
  }
  void set_items(const ValuePtr& dict, const std::vector<ValuePtr>& items) {
    if (dict->kind != Value::Kind::kDict) fail("setitem on a " + std::string(kind_name(dict->kind)));
    for (size_t k = 0; k + 1 < items.size(); k += 2) dict->dict.emplace_back(items[k], items[k + 1]);
  }

  // An OrderedDict's BUILD carries its attributes (a state_dict's _metadata: versions per module);
  // they hold no tensors.
  void build(const ValuePtr& state, const ValuePtr& object) {
    if (object->kind != Value::Kind::kDict && object->kind != Value::Kind::kTensor) {
      fail("BUILD on a " + std::string(kind_name(object->kind)));
    }
  }

  std::vector<int64_t> ints(const Value& v, const char* what) {
    if (v.kind != Value::Kind::kTuple) fail(std::string(what) + " is not a tuple");
    std::vector<int64_t> out;
    for (const auto& item : v.items) {
      if (item->kind != Value::Kind::kInt) fail(std::string(what) + " holds a " + kind_name(item->kind));
      out.push_back(item->i);
    }
    return out;
  }

  ValuePtr reduce(const Value& callable, const Value& args) {
    if (callable.kind != Value::Kind::kGlobal || args.kind != Value::Kind::kTuple) fail("REDUCE of a non-global");
    const std::string& name = callable.s;
    if (name == "collections.OrderedDict") {
      if (!args.items.empty()) fail("OrderedDict built from arguments");
      return make(Value::Kind::kDict);
    }
    if (name == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(args);
    if ((name == "torch._utils._rebuild_parameter" || name == "torch.jit._pickle.restore_type_tag") &&
        !args.items.empty()) {
      return args.items[0];  // a Parameter's data; a typed container (libtorch's pickle_save)
    }
    fail("unsupported global " + name);
  }

  // (storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])
  ValuePtr rebuild_tensor(const Value& args) {
    if (args.items.size() < 4 || args.items[0]->kind != Value::Kind::kStorage ||
        args.items[1]->kind != Value::Kind::kInt) {
      fail("malformed _rebuild_tensor_v2 arguments");
    }
    const Value& storage = *args.items[0];
    const int64_t offset = args.items[1]->i;
    const std::vector<int64_t> sizes = ints(*args.items[2], "tensor size");
    const std::vector<int64_t> strides = ints(*args.items[3], "tensor stride");
    if (sizes.size() != strides.size()) fail("tensor size and stride differ in length");
    const int64_t numel = static_cast<int64_t>(storage.storage.nbytes() / at::elementSize(storage.dtype));
    int64_t last = offset;  // the furthest element the view reaches must lie inside the storage
    bool empty = false;
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) fail("negative tensor size or stride");
      if (sizes[d] == 0) empty = true;
      int64_t reach = 0;
      if (__builtin_mul_overflow(sizes[d] == 0 ? 0 : sizes[d] - 1, strides[d], &reach) ||
          __builtin_add_overflow(last, reach, &last)) {
        fail("tensor size and stride overflow int64");
      }
    }
    if (offset < 0 || (!empty && last >= numel)) fail("tensor reaches past its storage");
    auto v = make(Value::Kind::kTensor);
    v->tensor = at::empty({0}, at::TensorOptions().dtype(storage.dtype)).set_(storage.storage, offset, sizes, strides);
    return v;
  }

  // ('storage', torch.<T>Storage, key, location, numel): the bytes are the archive's data/<key>.
  ValuePtr persistent(const ValuePtr& pid) {
    if (pid->kind != Value::Kind::kTuple || pid->items.size() < 5 || pid->items[0]->s != "storage" ||
        pid->items[1]->kind != Value::Kind::kGlobal || pid->items[2]->kind != Value::Kind::kStr ||
        pid->items[4]->kind != Value::Kind::kInt) {
      fail("unsupported persistent id");
    }
    auto type = storage_types().find(pid->items[1]->s);
    if (type == storage_types().end()) fail("unsupported storage type " + pid->items[1]->s);
    const std::string& key = pid->items[2]->s;
    auto cached = storages_.find(key);
    if (cached != storages_.end()) return cached->second;
    const int64_t numel = pid->items[4]->i;
    const size_t element = at::elementSize(type->second);
    // A negative count made an empty storage claim 2^64 - k bytes, and a tensor on it read through
    // a null pointer (fuzz/corpus/pickle/regression-negative-storage-size.pkl).
    if (numel < 0 || static_cast<uint64_t>(numel) > std::numeric_limits<size_t>::max() / element) {
      fail("storage of " + std::to_string(numel) + " elements");
    }
    const size_t nbytes = static_cast<size_t>(numel) * element;
    at::DataPtr data;
    if (numel > 0) {
      const std::string record = "data/" + key;
      size_t size = 0;
      try {
        if (!archive_.hasRecord(record)) fail("the archive has no " + record);
        std::tie(data, size) = archive_.getRecord(record);
      } catch (const c10::Error& e) {  // a damaged zip entry (bad header, checksum or compression)
        fail("the archive's " + record + " cannot be read: " + e.what_without_backtrace());
      }
      if (size < nbytes) fail(record + " holds " + std::to_string(size) + " bytes, not " + std::to_string(nbytes));
    }
    auto v = make(Value::Kind::kStorage);
    v->dtype = type->second;
    v->storage = at::Storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data), /*allocator=*/nullptr,
                             /*resizable=*/false);
    storages_[key] = v;
    return v;
  }

  std::string path_;
  caffe2::serialize::PyTorchStreamReader& archive_;
  pickle::OpcodeReader ops_;
  size_t at_ = 0;  // the opcode being run, for messages
  std::vector<ValuePtr> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
  std::map<std::string, ValuePtr> storages_;
  std::vector<ValuePtr> containers_;
};

}  // namespace

StateDict read_torch_save_dict(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> archive;
  at::DataPtr pickle;
  size_t size = 0;
  try {
    archive = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
    std::tie(pickle, size) = archive->getRecord("data.pkl");
  } catch (const c10::Error& e) {
    throw StateDictError("read_state_dict: " + path + " is not a readable torch.save archive: " +
                         e.what_without_backtrace());
  }
  return read_pickled_dict(path, *archive, static_cast<const char*>(pickle.get()), size);
}

StateDict read_pickled_dict(const std::string& path, caffe2::serialize::PyTorchStreamReader& archive,
                            const char* pickle, size_t size) {
  Machine machine(path, archive, pickle, size);
  ValuePtr root = machine.run();
  if (root->kind != Value::Kind::kDict) {
    throw StateDictError("read_state_dict: " + path + " holds a " + kind_name(root->kind) +
                         ", not a dict of tensors; save model.state_dict(), not the model");
  }
  StateDict out;
  for (const auto& [key, value] : root->dict) {
    if (key->kind != Value::Kind::kStr) {
      throw StateDictError("read_state_dict: " + path + " has a " + kind_name(key->kind) + " key, not a string");
    }
    if (value->kind != Value::Kind::kTensor) {
      throw StateDictError("read_state_dict: " + path + ": the value of " + key->s + " is a " +
                           kind_name(value->kind) + ", not a tensor");
    }
    out.emplace_back(key->s, value->tensor);
  }
  return out;
}

}  // namespace chorus::models::detail
