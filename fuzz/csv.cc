// Fuzz target: CSV datasets (include/chorus/data/csv_dataset.h): the RFC 4180 parser, then the
// dataset built from the text as make_csv_dataset does, as a single-label CSV (path,label) and as
// a multi-label one (every other column a 0/1 label) with its grouped split. Bad text must raise
// DataError, nothing else.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "chorus/data/byte_source.h"
#include "chorus/data/csv_dataset.h"

namespace data = chorus::data;

namespace {

// The dataset never reads: building it only needs a source and a decode function to hold.
class NoSource : public data::ByteSource {
 public:
  std::vector<uint8_t> read(const std::string& key) override { return {}; }
  std::vector<std::string> list(const std::string& prefix) override { return {}; }
  std::string describe(const std::string& key) const override { return "fuzz:" + key; }
};

void build(const std::string& text, const data::CsvDatasetOptions& options, bool split) {
  try {
    const data::ImageDataset ds = data::make_csv_dataset_from_text(
        text, "fuzz.csv", std::make_shared<NoSource>(),
        [](const std::vector<uint8_t>&, const data::ItemInfo&) { return at::Tensor(); }, options);
    if (ds.size() == 0) std::abort();  // "a header but no rows" is an error
    for (size_t i = 0; i < ds.size(); ++i) {
      if (ds.sample(i).key.empty()) std::abort();
    }
    if (split) {
      const data::DatasetSplit parts = data::grouped_split(ds, 0.25, 7);
      if (parts.train.size() + parts.val.size() != ds.size()) std::abort();
    }
  } catch (const data::DataError&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::string text(reinterpret_cast<const char*>(bytes), size);
  std::vector<data::CsvRecord> records;
  try {
    records = data::parse_csv(text, "fuzz.csv");
  } catch (const data::DataError&) {
    return 0;
  }
  int64_t line = 0;
  for (const auto& r : records) {
    if (r.line <= line || r.fields.empty()) std::abort();  // lines only go forward
    line = r.line;
  }
  build(text, data::CsvDatasetOptions{}, false);
  // Multi-label: every column but path and the group ("group" or "patient") is a 0/1 label, as in
  // the CSVs `chorus data render-fashion-mnist --csv` and `render-fashion-mnist-pairs` write.
  if (!records.empty() && records[0].fields.size() > 2) {
    data::CsvDatasetOptions multi;
    multi.label_columns.clear();
    for (const std::string& name : records[0].fields) {
      if (name == "group" || name == "patient") {
        multi.group_column = name;
      } else if (name != multi.path_column) {
        multi.label_columns.push_back(name);
      }
    }
    if (!multi.label_columns.empty()) build(text, multi, true);
  }
  return 0;
}
