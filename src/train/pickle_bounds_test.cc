// check_pickle_bounds on hand-made pickles: what libtorch's pickler writes passes; claims beyond the
// bytes left, memo indices past the entries stored, truncation and a missing STOP are refused.
// (checkpoint_test round-trips real model.pt and rng.pt files through it.) Also state.json's
// integers, which must be JSON integers.

#include "pickle_bounds.h"

#include <gtest/gtest.h>

#include <string>

#include "checkpoint_internal.h"
#include "chorus/train/checkpoint.h"

namespace chorus::train::detail {
namespace {

using namespace std::string_literals;

std::string u32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

void check(const std::string& pickle) { check_pickle_bounds(pickle.data(), pickle.size(), "model.pt"); }

std::string refusal(const std::string& pickle) {
  try {
    check(pickle);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

// {"fc.weight": <persistent storage>} as libtorch writes it, reduced to the opcodes that matter.
const std::string kGood = "\x80\x02}q\x00(X"s + u32(9) + "fc.weightq\x01"s +
                          "ctorch._utils\n_rebuild_tensor_v2\nq\x02((X"s + u32(7) + "storageq\x03"s +
                          "ctorch\nFloatStorage\nq\x04X"s + u32(1) + "0q\x05X"s + u32(3) + "cpuq\x06K\x06tq\x07"s +
                          "QK\x00K\x02K\x03\x86q\x08K\x03K\x01\x86q\x09\x89h\x00tq\x0aRq\x0bu."s;

TEST(PickleBounds, WhatAPicklerWritesPasses) {
  EXPECT_NO_THROW(check(kGood));
  EXPECT_NO_THROW(check("\x80\x02]q\x00(K\x01M\x00\x01J"s + u32(7) + "G" + std::string(8, '\0') + "e."));
  EXPECT_NO_THROW(check("\x80\x04\x95"s + std::string(8, '\0') + "\x8c\x01"s + "a\x94h\x00."s));
}

TEST(PickleBounds, AStringLongerThanThePickleIsRefusedBeforeItIsRead) {
  // The fuzzer's case: BINUNICODE claiming 3.9 GB in a few bytes.
  const std::string why = refusal("\x80\x02X" + u32(0xE8D4A510u) + "abc.");
  EXPECT_NE(why.find("model.pt is damaged"), std::string::npos) << why;
  EXPECT_NE(why.find("claims 3906250000 bytes where 4 are left"), std::string::npos) << why;
  EXPECT_FALSE(refusal("\x80\x02" "B" + u32(100) + "short.").empty());
  EXPECT_FALSE(refusal(std::string("\x80\x02" "\x8e") + "\xff\xff\xff\xff\xff\xff\xff\x7f" + ".").empty());
  EXPECT_FALSE(refusal("\x80\x02\x8c\x05" "abc").empty());
}

TEST(PickleBounds, MemoIndicesFollowTheEntriesStored) {
  EXPECT_NE(refusal("\x80\x02N" "r" + u32(0xFFFFFFF0u) + ".").find("stores memo entry 4294967280 after 0"),
            std::string::npos);
  EXPECT_NE(refusal("\x80\x02Nq\x00h\x01."s).find("reads memo entry 1 of 1"), std::string::npos);
  EXPECT_NO_THROW(check("\x80\x02Nq\x00q\x00h\x00."s));  // storing an entry again is allowed
}

TEST(PickleBounds, TruncatedArgumentsAndAMissingStopAreRefused) {
  EXPECT_FALSE(refusal("\x80\x02J\x01\x02").empty());
  EXPECT_FALSE(refusal("\x80\x02G\x00\x00").empty());
  EXPECT_FALSE(refusal("\x80\x02" "ctorch\nFloat").empty());
  EXPECT_NE(refusal("\x80\x02N").find("ends without STOP"), std::string::npos);
  EXPECT_FALSE(refusal("").empty());
}

TEST(PickleBounds, AnOpcodeItDoesNotKnowLeavesTheRestToTheUnpickler) {
  EXPECT_NO_THROW(check("\x80\x02\xff" "X" + u32(0xFFFFFFFFu)));
}

// A zip of one entry: `pad` bytes of local data, the central directory entry, the end record.
std::string zip_with_entry(uint32_t method, uint32_t uncompressed, size_t pad) {
  auto u16 = [](uint32_t v) { return std::string{static_cast<char>(v & 0xff), static_cast<char>(v >> 8)}; };
  const std::string name = "archive/data.pkl";
  std::string z(pad, 'x');
  const uint32_t dir = static_cast<uint32_t>(z.size());
  z += u32(0x02014b50) + u16(20) + u16(20) + u16(0) + u16(method) + u16(0) + u16(0) + u32(0) + u32(10) +
       u32(uncompressed) + u16(static_cast<uint32_t>(name.size())) + u16(0) + u16(0) + u16(0) + u16(0) + u32(0) +
       u32(0) + name;
  const uint32_t dir_size = static_cast<uint32_t>(z.size()) - dir;
  z += u32(0x06054b50) + u16(0) + u16(0) + u16(1) + u16(1) + u32(dir_size) + u32(dir) + u16(0);
  return z;
}

TEST(ZipSizes, AnEntryClaimingMoreThanTheArchiveCanHoldIsRefused) {
  EXPECT_NO_THROW(check_zip_sizes(zip_with_entry(0, 100, 200).data(), zip_with_entry(0, 100, 200).size(), "model.pt"));
  const std::string stored = zip_with_entry(0, 0xff000000u, 200);
  try {
    check_zip_sizes(stored.data(), stored.size(), "model.pt");
    ADD_FAILURE() << "a 4 GB stored entry in a small archive passed";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("zip entry 'archive/data.pkl' claims 4278190080 bytes"), std::string::npos)
        << e.what();
  }
  const std::string deflated = zip_with_entry(8, 100000, 200);  // within deflate's 1032:1
  EXPECT_NO_THROW(check_zip_sizes(deflated.data(), deflated.size(), "model.pt"));
  const std::string not_a_zip = "no central directory here";
  EXPECT_NO_THROW(check_zip_sizes(not_a_zip.data(), not_a_zip.size(), "model.pt"));  // the zip reader refuses it
}

// zip_with_entry's archive with the zip64 end record and locator torch.save writes before the end
// record, and the plain end record's directory offset damaged: a reader going by the zip64 record
// (miniz, libtorch's) still finds the entry.
std::string zip64_with_entry(uint32_t uncompressed) {
  auto u16 = [](uint32_t v) { return std::string{static_cast<char>(v & 0xff), static_cast<char>(v >> 8)}; };
  auto u64 = [](uint64_t v) { return u32(static_cast<uint32_t>(v)) + u32(static_cast<uint32_t>(v >> 32)); };
  std::string z = zip_with_entry(0, uncompressed, 200);
  const size_t end = z.size() - 22;
  const uint64_t dir = 200, dir_size = end - dir;
  std::string tail = z.substr(end);
  z.resize(end);
  const uint64_t eocd64 = z.size();
  z += u32(0x06064b50) + u64(44) + u16(45) + u16(45) + u32(0) + u32(0) + u64(1) + u64(1) + u64(dir_size) + u64(dir);
  z += u32(0x07064b50) + u32(0) + u64(eocd64) + u32(1);
  tail.replace(16, 4, u32(430592));  // the plain record's directory offset, past the end
  return z + tail;
}

TEST(ZipSizes, TheZip64EndRecordIsWhatCounts) {
  const std::string ok = zip64_with_entry(100);
  EXPECT_NO_THROW(check_zip_sizes(ok.data(), ok.size(), "model.pt"));
  const std::string bomb = zip64_with_entry(0xff000060u);  // found by fuzz_checkpoint (regression-zip64-directory)
  try {
    check_zip_sizes(bomb.data(), bomb.size(), "model.pt");
    ADD_FAILURE() << "an entry found through the zip64 end record was not checked";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("claims 4278190176 bytes"), std::string::npos) << e.what();
  }
}

TEST(CheckpointStateJson, IntegersMustBeJsonIntegers) {
  EXPECT_EQ(parse_checkpoint_state(R"({"epoch": 3, "step": 1234})").step, 1234);
  // A float out of int64's range was converted by a C++ cast (undefined behaviour; fuzz_checkpoint).
  for (const char* bad : {R"({"epoch": 1.2e51, "step": 1})", R"({"epoch": 1, "step": 2.5})",
                          R"({"epoch": 18446744073709551615, "step": 1})", R"({"epoch": "3", "step": 1})"}) {
    EXPECT_THROW(parse_checkpoint_state(bad), CheckpointError) << bad;
  }
}

}  // namespace
}  // namespace chorus::train::detail
