#pragma once
// Training observability (issue 14, "Metrics"): a progress line per step, the
// step's scalars as JSONL, and TensorBoard event files, all under
// --metrics-log-dir.
//
// The trainer names its scalars: train/loss, train/grad_norm, train/lr/<group>,
// train/tokens, train/tokens_per_s, time/step_s, memory/peak_rss_bytes.
//
// DIR/metrics.jsonl: one object per step, {"step": N, "time": <unix s>,
// "<name>": value, ...} in the order given; a non-finite value is null. Each
// line is written with one write(2), so a crash loses at most that line.
//
// DIR/events.out.tfevents.<unix s>.<host>.<pid>.areno: a new file per run,
// TFRecords (length, masked CRC32C, data, masked CRC32C) around
// tensorflow.Event protobufs, encoded by hand: a file_version event, a
// SessionLog START, then one Event with a Summary of simple_values per step.
//
// Resuming at step R: metrics.jsonl keeps only its lines with step <= R (the
// rewrite goes through AtomicFile), and the new event file's START is at step
// R + 1: on a START after the first, TensorBoard drops the steps > R that the
// earlier files hold, so neither view has a step twice. A fresh run is R = 0:
// metrics.jsonl starts empty and TensorBoard drops older runs' steps.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace areno::train {

// (name, value) pairs, written in this order.
using Scalars = std::vector<std::pair<std::string, double>>;

class MetricsWriter {
 public:
  // Creates `dir` if missing. Throws std::runtime_error naming the path and
  // the reason when the folder or a file cannot be created or written.
  MetricsWriter(const std::filesystem::path& dir, int64_t resume_step);
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // One JSONL line and one event; "step" and "time" are not scalar names.
  void write(int64_t step, const Scalars& scalars);

  const std::filesystem::path& jsonl_path() const { return jsonl_.path; }
  const std::filesystem::path& events_path() const { return events_.path; }

 private:
  // A file written with write(2) only (nothing buffered here); closed on destruction.
  struct Output {
    std::filesystem::path path;
    int fd = -1;
    void append(std::string_view data);
    ~Output();
  };
  Output jsonl_, events_;
};

struct ProgressInfo {
  int64_t step = 0, total_steps = 0;  // total_steps <= 0: unknown
  double loss = 0;
  std::vector<std::pair<std::string, double>> lrs;  // (group, lr)
  double grad_norm = 0;
  double tokens_per_s = 0;
  double elapsed_s = 0;
};

// "step 12/300  loss 2.3456  lr lm 1.00e-05 projector 5.00e-05  grad_norm 0.873
//  tok/s 1234  elapsed 1m02s  eta 24m48s" (one line). ETA = elapsed / step *
// (total - step): "eta ?" before the first step; no total and no ETA when the
// total is unknown.
std::string format_progress(const ProgressInfo& p);

// "lr lm 1.00e-05 projector 5.00e-05": each trained group's learning rate, as
// the progress lines show them.
std::string format_group_lrs(const std::vector<std::pair<std::string, double>>& lrs);

// "7s", "1m02s", "2h03m04s" (rounded to the second); "?" for a negative or
// non-finite duration.
std::string format_duration(double seconds);

// Seconds on the steady clock since `t`.
double seconds_since(std::chrono::steady_clock::time_point t);

// The process's peak resident set (VmHWM in /proc/self/status) in bytes; 0
// when unavailable.
int64_t peak_rss_bytes();

// CRC-32C (Castagnoli), and TFRecord's masked form of it.
uint32_t crc32c(std::string_view data);
uint32_t masked_crc32c(std::string_view data);

}  // namespace areno::train
