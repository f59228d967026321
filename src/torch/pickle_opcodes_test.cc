// The opcode reader against Python's own: pickles of every protocol (0-5), written by CPython's
// pickle, read opcode by opcode here and by pickletools.genops there, must agree on each opcode,
// its offset and its argument. Then the damaged forms: arguments past the end, lines without a
// newline, unknown opcodes.
#include "chorus/torch/pickle_opcodes.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace chorus::pickle {
namespace {

std::string run(const std::string& command) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) return "";
  return out;
}

std::string unhex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

// Python writes, per protocol: "pickle <hex>", then per opcode "<offset> <code> <arg>", where arg is
// "-" (none), "i<int>" or "s<hex of the bytes>" (strings as UTF-8; GLOBAL as "module name").
const char* kScript = R"PY(
import pickle, pickletools, collections
obj = {"ints": [0, 1, 255, 256, 65535, 65536, -1, -2**31, 2**31, 2**63 + 5, -(2**70)],
       "float": 1.5, "text": "h\u00e9llo", "bytes": b"\x00\xff", "array": bytearray(b"ab"),
       "nested": (None, True, False, (1,), (1, 2), (1, 2, 3), ()), "set": {3}, "frozen": frozenset([4]),
       "od": collections.OrderedDict(a=1), "long_text": "x" * 300}
obj["again"] = obj["nested"]
for proto in range(6):
    data = pickle.dumps(obj, protocol=proto)
    print("pickle", data.hex())
    for op, arg, pos in pickletools.genops(data):
        if arg is None: a = "-"
        elif isinstance(arg, bool): a = "i%d" % arg
        elif isinstance(arg, int): a = "i%d" % arg
        elif isinstance(arg, float): a = "-"
        elif isinstance(arg, bytes): a = "s" + arg.hex()
        elif isinstance(arg, str): a = "s" + arg.encode("utf-8", "surrogatepass").hex()
        else: a = "-"
        print(pos, op.code.encode("latin-1")[0], a)
)PY";

TEST(OpcodeReader, AgreesWithPythonsPickletoolsOnEveryProtocol) {
  const std::string out = run("/usr/bin/python3 -c '" + std::string(kScript) + "' 2>/dev/null");
  if (out.empty()) GTEST_SKIP() << "/usr/bin/python3 is not available";
  std::istringstream lines(out);
  std::string word;
  int pickles = 0;
  std::string data;
  OpcodeReader reader(nullptr, 0);
  size_t ops = 0;
  while (lines >> word) {
    if (word == "pickle") {
      Op after;
      if (pickles > 0) {
        EXPECT_FALSE(reader.next(&after)) << "the reader reads past Python's last opcode";
      }
      std::string hex;
      lines >> hex;
      data = unhex(hex);
      reader = OpcodeReader(data.data(), data.size());
      ++pickles;
      continue;
    }
    const size_t offset = std::stoul(word);
    int code = 0;
    std::string arg;
    lines >> code >> arg;
    SCOPED_TRACE("pickle " + std::to_string(pickles - 1) + ", offset " + std::to_string(offset));
    Op op;
    ASSERT_TRUE(reader.next(&op));
    ++ops;
    EXPECT_EQ(op.offset, offset);
    EXPECT_EQ(op.code, code);
    EXPECT_NE(op.kind, ArgKind::kUnknown);
    if (arg[0] == 's') {
      std::string text(op.bytes);
      if (op.kind == ArgKind::kTwoLines) text += " " + std::string(op.second_line);
      // Python decodes STRING's and UNICODE's text lines (a repr, raw-unicode-escape); the reader
      // gives the line as written.
      if (op.code != 'S' && op.code != 'V') {
        EXPECT_EQ(text, unhex(arg.substr(1)));
      }
    } else if (arg[0] == 'i' && op.kind == ArgKind::kFixed && op.code != 'J') {
      EXPECT_EQ(std::to_string(op.number), arg.substr(1));
    } else if (arg[0] == 'i' && op.kind == ArgKind::kFixed) {
      EXPECT_EQ(std::to_string(static_cast<int32_t>(op.number)), arg.substr(1));
    } else if (arg[0] == 'i' && op.kind == ArgKind::kLine && op.code != 'I' && op.code != 'L') {
      EXPECT_EQ(std::string(op.bytes), arg.substr(1));  // text GET and PUT: the memo id
    }
  }
  EXPECT_EQ(pickles, 6);
  EXPECT_GT(ops, 300u);
}

std::string error_of(const std::string& pickle) {
  OpcodeReader reader(pickle.data(), pickle.size());
  Op op;
  try {
    while (reader.next(&op)) {
      if (op.kind == ArgKind::kUnknown) return "unknown opcode at " + std::to_string(op.offset);
    }
  } catch (const FormatError& e) {
    return std::string(e.what()) + " at " + std::to_string(e.offset());
  }
  return "ok";
}

TEST(OpcodeReader, RefusesArgumentsPastTheEndBeforeReadingThem) {
  EXPECT_EQ(error_of(std::string("\x80\x02N.", 4)), "ok");
  // BINUNICODE claiming 3.9 GB in a 10-byte pickle.
  EXPECT_EQ(error_of(std::string("\x80\x02X\x10\xa5\xd4\xe8" "ab.", 10)), "claims 3906250000 bytes where 3 are left at 2");
  // The count itself cut short; a fixed argument cut short.
  EXPECT_EQ(error_of(std::string("\x80\x02X\x01\x00", 5)), "claims 4 bytes where 2 are left at 2");
  EXPECT_EQ(error_of(std::string("\x80\x02G\x00\x00", 5)), "claims 8 bytes where 2 are left at 2");
  EXPECT_EQ(error_of(std::string("\x80\x02\x8e\xff\xff\xff\xff\xff\xff\xff\xff.", 12)),
            "claims 18446744073709551615 bytes where 1 are left at 2");
  EXPECT_EQ(error_of("cos\nsystem"), "has a text argument without its newline at 0");
  EXPECT_EQ(error_of("I12"), "has a text argument without its newline at 0");
  EXPECT_EQ(error_of(std::string("\x80\x02\xff.", 4)), "unknown opcode at 2");
  EXPECT_EQ(arg_layout(0xff).kind, ArgKind::kUnknown);
}

}  // namespace
}  // namespace chorus::pickle
