// `areno batch`: OpenAI batch files run through the server's own routes, as
// vLLM's run_batch does. The whole file is checked before any request runs;
// then the requests go to an in-process `areno serve` on a loopback port
// (the same parsing, limits, engine and responses as over HTTP), several at
// once so the engine batches them, and the results are written in input
// order to a temporary file that is fsynced and renamed over --output-file.
#include <fmt/format.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "app/commands_serve.h"
#include "app/flags.h"
#include "nn/io/atomic_file.h"
#include "serve/openai.h"

namespace areno::app {

namespace {

constexpr const char* kBatchUsage =
    "usage: areno batch -i FILE -o FILE [--model-path DIR] [options]\n"
    "\n"
    "Runs an OpenAI batch file (vLLM's run_batch): one JSON object per line,\n"
    "  {\"custom_id\": \"...\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {...}}\n"
    "with url /v1/chat/completions, /v1/completions or /v1/responses and the body of the\n"
    "route (no streaming). Every line is checked first; a bad line stops the run\n"
    "before any request, naming the file, the line and the field. The requests then run\n"
    "through this build's server routes (an in-process server on a loopback port),\n"
    "several at once so the engine batches them, and each gets one output line in\n"
    "input order:\n"
    "  {\"id\": \"batch_req_...\", \"custom_id\": ..., \"response\": {\"status_code\": 200,\n"
    "   \"request_id\": ..., \"body\": {...}}, \"error\": null}\n"
    "(a request the server refuses keeps its status and OpenAI error body). The\n"
    "output is written to a temporary file, fsynced and renamed over --output-file\n"
    "once every request is done; an interrupted run writes nothing.\n"
    "\n"
    "batch:\n"
    "  -i, --input-file FILE     the batch file (JSONL; blank lines are skipped)\n"
    "  -o, --output-file FILE    where the results go (replaced as a whole)\n"
    "  --max-concurrency N       requests in flight at once (default 2 x --max-running-prompts)\n"
    "\n"
    "and the model, engine, request and media flags of `areno serve` (--model-path,\n"
    "--served-model-name, --dtype, --lora, --lora-modules, --max-running-prompts,\n"
    "--kv-cache-gb, --default-max-tokens, --max-body-mb, --media-root, --threads, ...;\n"
    "see `areno serve --help`).\n";

std::atomic<int> g_batch_signal{0};
extern "C" void on_batch_signal(int sig) { g_batch_signal = sig; }

struct BatchLine {
  size_t line = 0;  // 1-based, in the input file
  std::string custom_id;
  std::string url;
  std::string body;  // the request body, serialised
};

// Reads `path` line by line, refusing a line longer than `max_line` bytes
// before it is held whole.
std::vector<BatchLine> read_batch_file(const std::string& path, size_t max_line, int max_depth) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::invalid_argument(fmt::format("--input-file: cannot open '{}'", path));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(f, std::fclose);
  std::vector<BatchLine> out;
  std::set<std::string> ids;
  std::string line;
  size_t number = 0;
  auto fail = [&](const std::string& why) {
    return std::invalid_argument(fmt::format("{}:{}: {}", path, number, why));
  };
  auto take = [&]() {
    ++number;
    size_t b = 0, e = line.size();
    while (b < e && std::isspace(static_cast<unsigned char>(line[b]))) ++b;
    while (e > b && std::isspace(static_cast<unsigned char>(line[e - 1]))) --e;
    if (b == e) return;
    nlohmann::json j;
    try {
      j = serve::parse_json_bounded(line.substr(b, e - b), max_depth);
    } catch (const serve::ApiError& err) {
      throw fail(err.what());
    }
    if (!j.is_object()) throw fail(fmt::format("a line must be a JSON object (got {})", j.type_name()));
    BatchLine bl;
    bl.line = number;
    auto cid = j.find("custom_id");
    if (cid == j.end() || !cid->is_string() || cid->get<std::string>().empty())
      throw fail("'custom_id' must be a non-empty string");
    bl.custom_id = cid->get<std::string>();
    if (!ids.insert(bl.custom_id).second)
      throw fail(fmt::format("'custom_id' \"{}\" is used by an earlier line (each must be unique)", bl.custom_id));
    auto method = j.find("method");
    if (method == j.end() || !method->is_string() || method->get<std::string>() != "POST")
      throw fail("'method' must be \"POST\"");
    auto url = j.find("url");
    if (url == j.end() || !url->is_string() ||
        (url->get<std::string>() != "/v1/chat/completions" && url->get<std::string>() != "/v1/completions" &&
         url->get<std::string>() != "/v1/responses"))
      throw fail("'url' must be \"/v1/chat/completions\", \"/v1/completions\" or \"/v1/responses\"");
    bl.url = url->get<std::string>();
    auto body = j.find("body");
    if (body == j.end() || !body->is_object()) throw fail("'body' must be a JSON object (the route's request)");
    if (auto s = body->find("stream"); s != body->end() && s->is_boolean() && s->get<bool>())
      throw fail("'body.stream': a batch request cannot stream");
    bl.body = serve::dump_json(*body);
    out.push_back(std::move(bl));
  };
  char buf[1 << 16];
  size_t n;
  bool over = false;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) {
    for (size_t i = 0; i < n; ++i) {
      if (buf[i] == '\n') {
        if (over) {
          ++number;
          throw fail(fmt::format("the line is longer than {} bytes (--max-body-mb and 1 MiB for the line's other fields)",
                                 max_line));
        }
        take();
        line.clear();
        continue;
      }
      if (line.size() >= max_line) over = true;
      else line.push_back(buf[i]);
    }
  }
  if (std::ferror(f)) throw std::invalid_argument(fmt::format("--input-file: reading '{}' failed", path));
  if (over) {
    ++number;
    throw fail(fmt::format("the line is longer than {} bytes", max_line));
  }
  if (!line.empty()) take();
  return out;
}

}  // namespace

int cmd_batch(const Args& args) {
  ServeSetup setup;
  std::string input, output;
  int64_t concurrency = 0;
  Flags flags("batch", kBatchUsage);
  flags.value("-i", input).value("--input-file", input).value("-o", output).value("--output-file", output);
  flags.integer("--max-concurrency", concurrency, 1);
  add_serve_flags(flags, setup, /*http=*/false);
  if (auto rc = flags.parse(args)) return *rc;
  if (input.empty()) throw std::invalid_argument("--input-file (-i) is required");
  if (output.empty()) throw std::invalid_argument("--output-file (-o) is required");
  finish_serve_flags(setup);
  if (concurrency == 0) concurrency = 2 * setup.eo.max_running;

  // Every line checked before the model loads.
  const std::vector<BatchLine> lines =
      read_batch_file(input, setup.so.max_body_bytes + (size_t(1) << 20), setup.so.max_json_depth);
  AtomicFile out(output);  // the folder must exist: fail now, not after the run

  ServedModel m = load_for_serving(setup, "batch");
  serve::ServerOptions& so = setup.so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.api_key.clear();
  so.responses_store_bytes = 0;  // lines run at once and nothing reads a response back
  serve::Engine engine(m.model, m.tokenizer, setup.eo);
  serve::HttpServer server(engine, so);
  const int port = server.bind();
  std::signal(SIGPIPE, SIG_IGN);
  std::signal(SIGINT, on_batch_signal);
  std::signal(SIGTERM, on_batch_signal);
  // (No release_cpu_threads() as serve does: clang's libomp crashes in a later
  // omp_set_num_threads of the same process after a hard pause, and the tests
  // run several batches in one process; the load's idle workers sleep anyway.)
  engine.start();
  std::thread listener([&] { server.listen(); });

  // Results by line, written in order as they arrive.
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::optional<std::string>> results(lines.size());
  std::atomic<size_t> next{0};
  std::atomic<int64_t> failed{0};
  auto worker = [&] {
    httplib::Client cli("127.0.0.1", port);
    cli.set_connection_timeout(10, 0);
    cli.set_read_timeout(24 * 3600, 0);
    cli.set_write_timeout(600, 0);
    for (size_t k; (k = next++) < lines.size() && g_batch_signal == 0;) {
      const BatchLine& bl = lines[k];
      nlohmann::json o;
      o["id"] = serve::new_response_id("batch_req_");
      o["custom_id"] = bl.custom_id;
      httplib::Result r = cli.Post(bl.url.c_str(), bl.body, "application/json");
      if (!r) {
        o["response"] = nullptr;
        o["error"] = {{"code", "transport_error"},
                      {"message", fmt::format("the request did not complete: {}", httplib::to_string(r.error()))}};
        ++failed;
      } else {
        nlohmann::json body = nlohmann::json::parse(r->body, nullptr, false);
        if (body.is_discarded()) body = r->body;
        std::string request_id;
        if (body.is_object() && body.contains("id") && body["id"].is_string()) request_id = body["id"];
        o["response"] = {{"status_code", r->status}, {"request_id", request_id}, {"body", std::move(body)}};
        o["error"] = nullptr;
        if (r->status != 200) ++failed;
      }
      std::string text = serve::dump_json(o);
      text += '\n';
      {
        std::lock_guard<std::mutex> lk(mu);
        results[k] = std::move(text);
      }
      cv.notify_all();
    }
    cv.notify_all();
  };
  std::vector<std::thread> workers;
  for (int64_t i = 0; i < std::min<int64_t>(concurrency, int64_t(lines.size())); ++i) workers.emplace_back(worker);

  fmt::print(stderr, "areno batch: {} requests from {} ({} at once)\n", lines.size(), input,
             std::min<int64_t>(concurrency, int64_t(lines.size())));
  const auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  size_t written = 0;
  std::exception_ptr write_error;
  try {
    while (written < lines.size() && g_batch_signal == 0) {
      std::optional<std::string> text;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, std::chrono::milliseconds(500), [&] { return results[written].has_value(); });
        if (results[written]) text = std::move(results[written]);
      }
      if (text) {
        out.write(*text);
        results[written].reset();
        ++written;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now - last_report > std::chrono::seconds(5)) {
        fmt::print(stderr, "areno batch: {}/{} done, {} failed, {:.0f} s\n", written, lines.size(), failed.load(),
                   std::chrono::duration<double>(now - start).count());
        last_report = now;
      }
    }
  } catch (...) {  // the output could not be written: stop everything
    write_error = std::current_exception();
    g_batch_signal = -1;
  }
  // Interrupted: the requests in flight are aborted (their workers get the
  // answer at once); else every worker has finished its last request.
  if (g_batch_signal != 0) {
    server.begin_drain();
    engine.stop(/*drain=*/false);
  }
  for (std::thread& w : workers) w.join();
  server.begin_drain();
  engine.stop(/*drain=*/true);
  server.stop();
  listener.join();
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (write_error) std::rethrow_exception(write_error);
  if (g_batch_signal != 0)
    throw std::runtime_error(fmt::format("interrupted (signal {}) after {} of {} requests; {} was not written",
                                         int(g_batch_signal), written, lines.size(), output));
  out.commit();
  fmt::print(stderr, "areno batch: {} requests, {} not answered with 200, in {:.1f} s -> {}\n", lines.size(),
             failed.load(), std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), output);
  return 0;
}

}  // namespace areno::app
