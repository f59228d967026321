// ImageFolder listing (parity with torchvision 0.14), CSV datasets and grouped_split.
#include "chorus/data/image_folder.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "chorus/data/csv_dataset.h"
#include "data_test_util.h"

namespace chorus::data {
namespace {

using testing::TempDir;
using testing::write_file;

DecodeFn pgm_decoder() {
  return [](const std::vector<uint8_t>& bytes, const ItemInfo&) { return testing::decode_pgm(bytes); };
}

// Runs the torchvision script on `root`; nullopt when torchvision is missing.
std::optional<nlohmann::json> torchvision_listing(const std::string& root) {
  const std::string cmd = std::string("/usr/bin/python3 ") + CHORUS_IMAGE_FOLDER_PARITY_SCRIPT + " '" + root + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) out.append(buffer, n);
  const int status = ::pclose(pipe);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return nlohmann::json::parse(out);
}

void touch(const std::string& path) { write_file(path, ""); }

TEST(ImageFolderParity, SameListingAsTorchvision) {
  TempDir tmp;
  const std::string r = tmp.path;
  touch(r + "/README.txt");  // files directly under the root are not samples
  touch(r + "/root.jpg");
  for (const char* f : {"a.jpg", "B.JPG", "c.Jpeg", "d.txt", "e.png.bak", ".hidden.jpg", "f g.pgm", "noext", "z.webp",
                        "sub/x.PNG", "sub/y.tif", "sub b/q.bmp", "sub.d/r.ppm", "sub/deeper/s.TIFF", "dir.jpg/t.jpeg",
                        "sub-/u.png", "Sub/v.png"}) {
    touch(r + "/cat/" + f);
  }
  for (const char* f : {"1.jpg", "10.jpg", "2.jpg", "\xc3\xa9.jpg", "z.jpg", "_.jpg", "~.png"}) touch(r + "/Dog/" + f);
  touch(r + "/b-c/only.png");
  touch(r + "/a b/k.webp");
  touch(r + "/.hidden_class/x.jpg");
  std::filesystem::create_directory_symlink(r + "/Dog", r + "/cat/linked");  // followed, as os.walk(followlinks)
  std::filesystem::create_directory_symlink(r + "/b-c", r + "/linked_class");

  const auto python = torchvision_listing(r);
  if (!python) GTEST_SKIP() << "/usr/bin/python3 cannot import torchvision";
  ASSERT_FALSE(python->contains("error")) << python->dump();

  LocalByteSource source(r);
  const auto listing = list_image_folder(source);
  EXPECT_EQ(listing.classes, (*python)["classes"].get<std::vector<std::string>>());
  EXPECT_EQ(listing.class_to_idx, ((*python)["class_to_idx"].get<std::map<std::string, int64_t>>()));
  std::vector<std::pair<std::string, int64_t>> expected;
  for (const auto& s : (*python)["samples"]) expected.emplace_back(s[0].get<std::string>(), s[1].get<int64_t>());
  EXPECT_EQ(listing.samples, expected);
  EXPECT_GT(expected.size(), 25u);  // the tree is not trivially small

  // The same keys without directory entries (an object store's listing) list the same.
  std::vector<std::string> objects;
  for (auto& k : source.list("")) {
    if (k.back() != '/') objects.push_back(k);
  }
  std::reverse(objects.begin(), objects.end());
  const auto from_objects = list_image_folder(objects, "s3://bucket/train");
  EXPECT_EQ(from_objects.samples, listing.samples);
  EXPECT_EQ(from_objects.classes, listing.classes);
}

TEST(ImageFolderParity, EmptyClassFolderIsAnErrorAsInTorchvision) {
  TempDir tmp;
  const std::string r = tmp.path;
  touch(r + "/good/a.png");
  touch(r + "/no_images/notes.txt");
  touch(r + "/no_images/sub/readme.md");
  std::filesystem::create_directories(r + "/empty");
  const auto python = torchvision_listing(r);
  if (!python) GTEST_SKIP() << "/usr/bin/python3 cannot import torchvision";
  EXPECT_EQ((*python)["error"], "FileNotFoundError") << python->dump();
  EXPECT_NE((*python)["message"].get<std::string>().find("empty, no_images"), std::string::npos);

  LocalByteSource source(r);
  try {
    list_image_folder(source);
    FAIL() << "no error";
  } catch (const DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(r + "/empty, " + r + "/no_images"), std::string::npos) << what;
    EXPECT_NE(what.find(".jpg, .jpeg, .png"), std::string::npos) << what;
    EXPECT_EQ(what.find("/good"), std::string::npos) << what;
  }
}

TEST(ImageFolder, NoClassFolder) {
  TempDir tmp;
  touch(tmp.path + "/a.jpg");
  LocalByteSource source(tmp.path);
  try {
    list_image_folder(source);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("couldn't find any class folder in " + tmp.path), std::string::npos);
  }
  // An unusable root: one line naming it and the reason.
  auto root_error = [](const std::string& root) {
    try {
      LocalByteSource bad(root);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(root_error(tmp.path + "/a.jpg"), "LocalByteSource: " + tmp.path + "/a.jpg is not a directory");
  EXPECT_EQ(root_error(tmp.path + "/missing"), "LocalByteSource: " + tmp.path + "/missing: No such file or directory");
}

TEST(ImageFolder, ChosenClassesInTheirOrder) {
  const std::vector<std::string> keys = {"cat/", "cat/1.png", "cat/0.png", "dog/", "dog/a/2.jpg", "emu/", "emu/3.png",
                                         "owl/"};  // owl is empty, but not chosen
  ImageFolderOptions o;
  o.classes = {"emu", "cat"};
  const ImageFolderListing l = list_image_folder(keys, "/data", o);
  EXPECT_EQ(l.classes, (std::vector<std::string>{"emu", "cat"}));
  EXPECT_EQ(l.class_to_idx.at("cat"), 1);
  using S = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(l.samples, (S{{"emu/3.png", 0}, {"cat/0.png", 1}, {"cat/1.png", 1}}));
  o.classes = {"cat", "yak", "zebu"};
  try {
    list_image_folder(keys, "/data", o);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_STREQ(e.what(), "ImageFolder: no class folder yak, zebu in /data (it has cat, dog, emu, owl)");
  }
  o.classes = {"cat", "cat"};
  EXPECT_THROW(list_image_folder(keys, "/data", o), UsageError);
  o.classes = {"owl"};
  EXPECT_THROW(list_image_folder(keys, "/data", o), DataError);  // chosen and empty
}

TEST(ImageFolder, LinkCycleIsAnError) {
  TempDir tmp;
  touch(tmp.path + "/cat/a.jpg");
  std::filesystem::create_directory_symlink(tmp.path + "/cat", tmp.path + "/cat/loop");
  LocalByteSource source(tmp.path);
  try {
    source.list("");
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(tmp.path + "/cat/loop"), std::string::npos) << e.what();
  }
}

TEST(ImageFolder, DatasetReadsAndDecodesItems) {
  TempDir tmp;
  write_file(tmp.path + "/a/0.pgm", testing::pgm(3, 2, 10));
  write_file(tmp.path + "/b/0.pgm", testing::pgm(3, 2, 20));
  write_file(tmp.path + "/b/1.pgm", "garbage");
  auto ds = make_image_folder(std::make_shared<LocalByteSource>(tmp.path), pgm_decoder());
  ASSERT_EQ(ds.size(), 3u);
  EXPECT_EQ(ds.classes(), (std::vector<std::string>{"a", "b"}));
  auto e = ds.get(1);
  EXPECT_EQ(e.data.sizes(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(e.data.flatten()[0].item<int64_t>(), 20);
  EXPECT_EQ(e.target.item<int64_t>(), 1);
  try {
    ds.get(2);
    FAIL() << "no error";
  } catch (const DataError& err) {
    EXPECT_EQ(std::string(err.what()), tmp.path + "/b/1.pgm: not a binary 8-bit PGM (P5) image");
  }
}

// ---- CSV ----

std::shared_ptr<ByteSource> some_source(const TempDir& tmp) { return std::make_shared<LocalByteSource>(tmp.path); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const DataError& e) {
    return e.what();
  }
  return "no DataError";
}

TEST(Csv, ParsesRfc4180Quoting) {
  const std::string text =
      "\xEF\xBB\xBFpath,label\r\n\"a,b.jpg\",1\r\n\"say \"\"hi\"\".jpg\",2\n\n\"multi\nline.jpg\",0\nlast.jpg,3";
  const auto records = parse_csv(text, "t.csv");
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0].fields, (std::vector<std::string>{"path", "label"}));
  EXPECT_EQ(records[1].fields, (std::vector<std::string>{"a,b.jpg", "1"}));
  EXPECT_EQ(records[2].fields, (std::vector<std::string>{"say \"hi\".jpg", "2"}));
  EXPECT_EQ(records[3].fields, (std::vector<std::string>{"multi\nline.jpg", "0"}));
  EXPECT_EQ(records[3].line, 5);
  EXPECT_EQ(records[4].line, 7);
  EXPECT_EQ(records[4].fields, (std::vector<std::string>{"last.jpg", "3"}));
  EXPECT_EQ(parse_csv("a,,\"\"\n", "t.csv")[0].fields, (std::vector<std::string>{"a", "", ""}));
  EXPECT_NE(error_of([] { parse_csv("path\n\"open\n", "t.csv"); }).find("t.csv:2:1: the quoted field"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_csv("path\n\"a\"b\n", "t.csv"); }).find("t.csv:2:4: unexpected 'b'"),
            std::string::npos);
}

TEST(Csv, SingleAndMultiLabelDatasets) {
  TempDir tmp;
  auto single = make_csv_dataset_from_text("path,label,site\nx/a.pgm,3,p1\n\"y, b.pgm\",0,p2\n", "s.csv",
                                           some_source(tmp), pgm_decoder());
  ASSERT_EQ(single.size(), 2u);
  EXPECT_FALSE(single.multi_label());
  EXPECT_EQ(single.sample(1).key, "y, b.pgm");
  EXPECT_EQ(single.target(0).item<int64_t>(), 3);
  EXPECT_EQ(single.target(0).dim(), 0);

  CsvDatasetOptions o;
  o.path_column = "file";
  o.label_columns = {"dog", "cat"};
  o.group_column = "owner";
  auto multi = make_csv_dataset_from_text("cat,file,dog,owner\n1,a.pgm,0,ann\n0,b.pgm,1,bob\n", "m.csv",
                                          some_source(tmp), pgm_decoder(), o);
  EXPECT_TRUE(multi.multi_label());
  EXPECT_EQ(multi.classes(), (std::vector<std::string>{"dog", "cat"}));
  EXPECT_TRUE(multi.target(0).equal(at::tensor({0.0f, 1.0f})));
  EXPECT_EQ(multi.sample(1).group, "bob");
}

TEST(Csv, Errors) {
  TempDir tmp;
  auto make = [&](const std::string& text, CsvDatasetOptions o = {}) {
    return error_of([&] { make_csv_dataset_from_text(text, "d.csv", some_source(tmp), pgm_decoder(), o); });
  };
  EXPECT_NE(make("").find("d.csv: the CSV is empty"), std::string::npos);
  EXPECT_NE(make("\n\n").find("d.csv: the CSV is empty"), std::string::npos);
  EXPECT_NE(make("path,label\n").find("d.csv: the CSV has a header but no rows"), std::string::npos);
  EXPECT_NE(make("file,label\na.jpg,1\n").find("no column 'path' (the path column) in the header; the columns are "
                                               "'file', 'label'"),
            std::string::npos);
  CsvDatasetOptions g;
  g.group_column = "patient";
  EXPECT_NE(make("path,label\na.jpg,1\n", g).find("no column 'patient' (the group column)"), std::string::npos);
  EXPECT_NE(make("path,label\na.jpg,1\nb.jpg,cat\n").find("d.csv:3:2: bad label value 'cat' in column 'label'"),
            std::string::npos);
  EXPECT_NE(make("path,label\na.jpg,-1\n").find("d.csv:2:2: bad label value '-1'"), std::string::npos);
  EXPECT_NE(make("path,label\na.jpg,1.5\n").find("d.csv:2:2: bad label value '1.5'"), std::string::npos);
  CsvDatasetOptions m;
  m.label_columns = {"a", "b"};
  EXPECT_NE(make("path,a,b\nx.jpg,0,1\ny.jpg,1,2\n", m).find("d.csv:3:3: bad label value '2' in column 'b': expected 0 or 1"),
            std::string::npos);
  EXPECT_NE(make("path,label\na.jpg\n").find("d.csv:2: 1 fields where the header has 2"), std::string::npos);
  EXPECT_NE(make("path,label\n,1\n").find("d.csv:2:1: empty path"), std::string::npos);
  EXPECT_NE(error_of([&] { make_csv_dataset(tmp.path + "/none.csv", some_source(tmp), pgm_decoder()); })
                .find(tmp.path + "/none.csv: cannot open"),
            std::string::npos);
}

// A file that is not a CSV at all (random bytes, as a wrong path gives): the message escapes what
// it quotes, so no control code or invalid UTF-8 reaches the terminal, and it stays short.
TEST(Csv, ErrorsNeverEchoRawBytes) {
  TempDir tmp;
  std::mt19937 rng(7);
  std::string junk(4096, '\0');
  for (auto& c : junk) c = static_cast<char>(rng() & 0xff);
  const std::string message =
      error_of([&] { make_csv_dataset_from_text(junk, "j.csv", some_source(tmp), pgm_decoder(), {}); });
  ASSERT_NE(message.find("j.csv"), std::string::npos) << message;
  // No control byte, and every non-ASCII byte part of a well-formed UTF-8 sequence of a printable
  // code point (random bytes do form some: they are shown as the characters they are).
  for (size_t i = 0; i < message.size();) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    ASSERT_FALSE(c < 0x20 || c == 0x7f) << "byte " << int(c) << " at " << i << " in: " << message;
    const size_t n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    ASSERT_GT(n, 0u) << "byte " << int(c) << " at " << i << " in: " << message;
    ASSERT_FALSE(c == 0xc2 && i + 1 < message.size() && static_cast<unsigned char>(message[i + 1]) < 0xa0)
        << "a C1 control at " << i;
    for (size_t k = 1; k < n; ++k) {
      ASSERT_LT(i + k, message.size());
      ASSERT_EQ(static_cast<unsigned char>(message[i + k]) & 0xc0, 0x80) << "at " << i + k << " in: " << message;
    }
    i += n;
  }
  EXPECT_LT(message.size(), 4096u);
  const std::string header = std::string("path,la\x1b[2Jbel,caf\xc3\xa9,\xff\xfe\n") + "a.jpg,1,2,3\n";
  const std::string shown = error_of([&] { make_csv_dataset_from_text(header, "h.csv", some_source(tmp), pgm_decoder(), {}); });
  EXPECT_NE(shown.find("'path', 'la\\x1b[2Jbel', 'caf\xc3\xa9', '\\xff\\xfe'"), std::string::npos) << shown;
}

TEST(Csv, MissingImageIsAnErrorOfThatItemWhenRead) {
  TempDir tmp;
  write_file(tmp.path + "/labels.csv", "path,label\nthere.pgm,0\nmissing.pgm,1\n");
  write_file(tmp.path + "/there.pgm", testing::pgm(2, 2, 0));
  auto ds = make_csv_dataset(tmp.path + "/labels.csv", some_source(tmp), pgm_decoder());  // not checked here
  EXPECT_EQ(ds.get(0).data.numel(), 4);
  EXPECT_NE(error_of([&] { ds.get(1); }).find(tmp.path + "/missing.pgm: cannot open: No such file"),
            std::string::npos);
}

// ---- grouped_split ----

ImageDataset grouped_dataset(const TempDir& tmp, size_t items) {
  std::string text = "path,label,group\n";
  for (size_t i = 0; i < items; ++i) {
    // Groups of varied sizes (g0 largest), and every 7th item without a group.
    const std::string group = i % 7 == 0 ? "" : "g" + std::to_string((i * i) % 23);
    text += "item" + std::to_string(i) + ".pgm,0," + group + "\n";
  }
  CsvDatasetOptions o;
  o.group_column = "group";
  return make_csv_dataset_from_text(text, "g.csv", some_source(tmp), pgm_decoder(), o);
}

TEST(GroupedSplit, NeverSplitsAGroupAndIsDeterministic) {
  TempDir tmp;
  const auto ds = grouped_dataset(tmp, 200);
  std::set<std::vector<std::string>> distinct_vals;
  for (uint64_t seed : {0ull, 1ull, 2ull, 12345ull}) {
    for (double fraction : {0.0, 0.1, 0.25, 0.5, 1.0}) {
      const auto split = grouped_split(ds, fraction, seed);
      const auto again = grouped_split(ds, fraction, seed);
      std::vector<std::string> train, val, train2, val2;
      for (size_t i = 0; i < split.train.size(); ++i) train.push_back(split.train.sample(i).key);
      for (size_t i = 0; i < split.val.size(); ++i) val.push_back(split.val.sample(i).key);
      for (size_t i = 0; i < again.train.size(); ++i) train2.push_back(again.train.sample(i).key);
      for (size_t i = 0; i < again.val.size(); ++i) val2.push_back(again.val.sample(i).key);
      EXPECT_EQ(train, train2);
      EXPECT_EQ(val, val2);
      EXPECT_EQ(train.size() + val.size(), ds.size());
      std::set<std::string> train_groups, val_groups, all(train.begin(), train.end());
      all.insert(val.begin(), val.end());
      EXPECT_EQ(all.size(), ds.size());  // disjoint and complete
      for (size_t i = 0; i < split.train.size(); ++i) train_groups.insert(split.train.sample(i).group);
      for (size_t i = 0; i < split.val.size(); ++i) val_groups.insert(split.val.sample(i).group);
      for (const auto& g : val_groups) {
        if (!g.empty()) {
          EXPECT_EQ(train_groups.count(g), 0u) << "group " << g << " on both sides";
        }
      }
      const auto target = static_cast<size_t>(std::llround(fraction * 200));
      EXPECT_GE(val.size(), target);
      EXPECT_LT(val.size(), target + 30);  // overshoots by less than one group (the largest holds < 30)
      // Both sides keep the dataset order (item numbers ascending).
      auto number = [](const std::string& k) { return std::stoi(k.substr(4)); };
      EXPECT_TRUE(std::is_sorted(val.begin(), val.end(), [&](auto& a, auto& b) { return number(a) < number(b); }));
      if (fraction == 0.25) distinct_vals.insert(val);
    }
  }
  EXPECT_GT(distinct_vals.size(), 1u);  // the seed matters
  EXPECT_THROW(grouped_split(ds, 1.5, 0), UsageError);
}

}  // namespace
}  // namespace chorus::data
