// `areno generate` and `areno score`: one request from the command line.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "app/commands_serve.h"
#include "app/flags.h"
#include "models/phi4mm/processor/chat_processor.h"
#include "models/phi4mm/kv_cache.h"
#include "serve/cfg.h"
#include "serve/engine.h"
#include "serve/grammar.h"
#include "serve/json_schema.h"
#include "serve/openai.h"

namespace areno::app {

namespace {

constexpr const char* kGenerateUsage =
    "usage: areno generate [--model-path DIR] --prompt TEXT [--system TEXT] [--image FILE] [--audio FILE]\n"
    "                      [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]\n"
    "                      [--no-chat-template] [--device cpu|cuda[:N]] [--dtype f32|bf16] [--check-weights]\n"
    "                      [--lora DIR] [--quantize int8] [--print-ids] [--speculative-tokens N] [--threads N]\n"
    "                      [--grammar-file FILE | --json-schema SCHEMA]\n"
    "\n"
    "Runs one chat request and streams the answer to stdout (statistics to stderr).\n"
    "  --model-path DIR    checkpoint (default: the embedded demo model, docs/demo.md)\n"
    "  --prompt TEXT       the user message\n"
    "  --system TEXT       a system message\n"
    "  --image / --audio   an image (PNG/JPEG/BMP/GIF/PNM) and/or audio (WAV/FLAC/MP3/OGG) file\n"
    "                      for the user message, through the checkpoint's towers\n"
    "  --max-tokens N      generated tokens at most (default 256)\n"
    "  --temperature T     0 = greedy (default 0)\n"
    "  --top-p P, --top-k K  nucleus / top-k sampling (default off)\n"
    "  --seed S            sampling seed (default 0)\n"
    "  --no-chat-template  tokenize --prompt as is (no <|user|> ... <|assistant|>)\n"
    "  --check-weights     refuse a checkpoint holding NaN or infinite weights, naming the tensor\n"
    "  --lora DIR          a PEFT LoRA folder run beside the vision/speech adapter (docs/training.md)\n"
    "  --quantize int8     weight-only int8 for the decoder and the tied head (per output channel\n"
    "                      scales, f32 activations; CPU only; about half the memory of bf16)\n"
    "  --print-ids         instead of streaming the text, print one JSON object:\n"
    "                      {\"prompt_ids\", \"ids\", \"logprobs\" (raw distribution), \"text\", \"finish_reason\"}\n"
    "  --speculative-tokens N  speculative decoding by prompt lookup, as areno serve's (the output\n"
    "                      is unchanged; default 0: off)\n"
    "  --threads N         compute threads (default: OMP_NUM_THREADS, else the physical cores)\n"
    "  --grammar-file FILE the answer is one sentence of this GBNF grammar (rule root), as\n"
    "                      areno serve's guided_grammar and llama-cli's --grammar-file\n"
    "  --json-schema SCHEMA  the answer is one instance of this JSON schema (its text), as\n"
    "                      areno serve's guided_json and llama-cli's --json-schema\n";

constexpr const char* kScoreUsage =
    "usage: areno score [--model-path DIR] --prompt TEXT --completion TEXT [--no-chat-template]\n"
    "                   [--device cpu|cuda[:N]] [--dtype f32|bf16] [--check-weights] [--lora DIR] [--quantize int8]\n"
    "                   [--threads N]\n"
    "\n"
    "Prints, as JSON, the log-probability of each token of --completion after --prompt\n"
    "(the packed training forward; no sampling) and their sum.\n"
    "  --model-path DIR    checkpoint (default: the embedded demo model, docs/demo.md)\n"
    "  --no-chat-template  tokenize --prompt as is (default: a user turn + <|assistant|>)\n"
    "  --check-weights     refuse a checkpoint holding NaN or infinite weights, naming the tensor\n"
    "  --lora DIR          a PEFT LoRA folder run beside the vision/speech adapter (docs/training.md)\n"
    "  --quantize int8     weight-only int8 for the decoder and the tied head (per output channel\n"
    "                      scales, f32 activations; CPU only; about half the memory of bf16)\n"
    "  --threads N         compute threads (default: OMP_NUM_THREADS, else the physical cores)\n";

// The request as a chat (or raw text): ids, adapter and media.
struct CliPrompt {
  std::vector<int64_t> ids;
  phi4mm::Adapter adapter = phi4mm::Adapter::none;
  std::vector<phi4mm::Media> media;
};

CliPrompt make_prompt(const ServedModel& m, const std::string& system, const std::string& prompt, bool chat_template,
                      const std::string& image = {}, const std::string& audio = {}) {
  CliPrompt out;
  if (!chat_template) {
    if (!image.empty() || !audio.empty())
      throw std::invalid_argument("--no-chat-template: media need the chat template (drop --image/--audio)");
    for (tok::TokenId id : m.tokenizer->encode(prompt)) out.ids.push_back(id);
    if (out.ids.empty()) throw std::invalid_argument("--prompt: the prompt is empty");
    return out;
  }
  nlohmann::json messages = nlohmann::json::array();
  if (!system.empty()) messages.push_back({{"role", "system"}, {"content", system}});
  nlohmann::json content = nlohmann::json::array();
  // Local files given on the command line: any path the user can read.
  auto file = [](const std::string& flag, const std::string& path) {
    if (!std::filesystem::is_regular_file(path)) throw std::invalid_argument(fmt::format("{}: no file '{}'", flag, path));
    return std::filesystem::absolute(path).string();
  };
  if (!image.empty()) content.push_back({{"type", "image_url"}, {"image_url", {{"url", file("--image", image)}}}});
  if (!audio.empty()) content.push_back({{"type", "audio_url"}, {"audio_url", {{"url", file("--audio", audio)}}}});
  content.push_back({{"type", "text"}, {"text", prompt}});
  messages.push_back({{"role", "user"}, {"content", content}});
  phi4mm::ProcessorOptions po = phi4mm::processor_options_for(*m.model);
  po.source.media_root.assign(1, '/');  // (assigning the literal trips GCC 12's false -Wrestrict)
  phi4mm::ProcessedChat pc;
  try {
    pc = phi4mm::process_chat(*m.tokenizer, messages, nullptr, po);
  } catch (const phi4mm::ProcessorError& e) {
    throw std::invalid_argument(e.what());
  }
  out.ids = pc.ids();
  out.adapter = pc.adapter;
  out.media = std::move(pc.media);
  return out;
}

// The flags generate and score share.
void add_common_flags(Flags& flags, std::string& model_path, std::string& prompt, bool& have_prompt,
                      bool& chat_template, std::string& device, std::string& dtype, ModelNeeds& needs) {
  flags.value("--model-path", model_path).value("--device", device).value("--dtype", dtype);
  flags.toggle("--check-weights", needs.check_weights);
  add_model_flags(flags, needs);
  flags.value("--prompt", [&](const std::string& v) {
    prompt = v;
    have_prompt = true;
  });
  flags.toggle("--no-chat-template", chat_template, false);
  flags.compute_threads();
}

// The constraint of --grammar-file or --json-schema; errors name the flag
// (and the file), and a --max-tokens below the shortest answer is refused.
std::shared_ptr<const serve::OutputConstraint> constraint(const tok::Tokenizer& tokenizer, int64_t vocab,
                                                          const std::string& grammar_file, const std::string& json_schema,
                                                          int64_t max_tokens) {
  const auto bytes = std::make_shared<const serve::TokenBytes>(tokenizer, vocab);
  std::shared_ptr<const serve::OutputConstraint> c;
  const std::string flag = grammar_file.empty() ? "--json-schema" : "--grammar-file " + grammar_file;
  try {
    if (!grammar_file.empty()) {
      std::ifstream f(grammar_file, std::ios::binary);
      if (!f) throw std::invalid_argument("cannot read the file");
      std::string text;
      text.resize(serve::Cfg::kMaxGrammarBytes + 1);
      f.read(text.data(), std::streamsize(text.size()));
      text.resize(size_t(f.gcount()));
      c = serve::Cfg::compile(bytes, text);
    } else {
      c = serve::OutputGrammar::json_schema(bytes, serve::JsonSchema::compile(serve::parse_ordered_json_bounded(json_schema, 64)));
    }
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  }
  if (max_tokens < c->min_tokens())
    throw std::invalid_argument(fmt::format("--max-tokens is {}, but the shortest answer {} allows takes {} tokens", max_tokens,
                                            flag, c->min_tokens()));
  return c;
}

}  // namespace

int cmd_generate(const Args& args) {
  std::string model_path, device = "cpu", dtype, prompt, system, image, audio;
  bool have_prompt = false, chat_template = true;
  serve::SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 256;
  p.seed = 0;
  Flags flags("generate", kGenerateUsage);
  ModelNeeds needs;
  add_common_flags(flags, model_path, prompt, have_prompt, chat_template, device, dtype, needs);
  flags.value("--system", system).value("--image", image).value("--audio", audio);
  flags.integer("--max-tokens", p.max_tokens, 1);
  flags.value("--temperature", [&](const std::string& v) {
    p.temperature = parse_bounded_flag("--temperature", v, serve::bounds::temperature);
  });
  flags.value("--top-p", [&](const std::string& v) { p.top_p = parse_bounded_flag("--top-p", v, serve::bounds::top_p); });
  flags.integer("--top-k", p.top_k, serve::bounds::kMinTopK);
  flags.value("--seed", [&](const std::string& v) { p.seed = uint64_t(parse_int_flag("--seed", v, 0)); });
  bool print_ids = false;
  flags.toggle("--print-ids", print_ids);
  int64_t speculative_tokens = 0;
  flags.integer("--speculative-tokens", speculative_tokens, 0);
  std::string grammar_file, json_schema;
  flags.value("--grammar-file", grammar_file).value("--json-schema", json_schema);
  if (auto rc = flags.parse(args)) return *rc;
  if (!grammar_file.empty() && !json_schema.empty())
    throw std::invalid_argument("--grammar-file and --json-schema both constrain the answer; give one");
  if (print_ids) p.logprobs = 0;
  if (!have_prompt) {
    fmt::print(stderr, "areno generate: --prompt is required\n\n{}", kGenerateUsage);
    return 2;
  }
  ServedModel m = load_served_model(model_path, device, dtype, needs);
  if (m.demo) fmt::print(stderr, "(no --model-path: the embedded demo model, docs/demo.md)\n");
  CliPrompt cp = make_prompt(m, system, prompt, chat_template, image, audio);
  serve::EngineOptions eo;
  eo.eos_token_ids = m.model->config().generation.eos_token_ids;
  eo.speculative_tokens = speculative_tokens;
  // A KV cache that holds the prompt and every requested token (at least 256
  // MiB): a fixed 256 MiB ended a 1,000-token prompt on the released sizes in
  // f32 after 35 of 128 tokens with "finish length".
  eo.kv_blocks = std::max(phi4mm::PagedKvCache::blocks_for_budget(*m.model, size_t(256) << 20, eo.block_size),
                          (int64_t(cp.ids.size()) + p.max_tokens + eo.block_size) / eo.block_size + 1);
  serve::Engine engine(m.model, m.tokenizer, eo);
  if (!grammar_file.empty() || !json_schema.empty())
    p.grammar = constraint(*m.tokenizer, m.model->config().text.vocab_size, grammar_file, json_schema, p.max_tokens);
  serve::Request r;
  r.prompt = cp.ids;
  r.adapter = cp.adapter;
  r.media = std::move(cp.media);
  r.params = p;
  const std::vector<int64_t> prompt_ids = r.prompt;
  std::vector<int64_t> ids;
  std::vector<float> logprobs;
  std::string text;
  int64_t generated = 0;
  std::string finish = "none", error;
  const auto t0 = std::chrono::steady_clock::now();
  double first_token_s = -1;
  engine.submit(std::move(r), [&](const serve::RequestOutput& o) {
    if (!o.error.empty()) error = o.error;
    if (o.sample < 0) return;
    if (!o.tokens.empty() && first_token_s < 0)
      first_token_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    generated += int64_t(o.tokens.size());
    ids.insert(ids.end(), o.tokens.begin(), o.tokens.end());
    for (const auto& lp : o.logprobs) logprobs.push_back(lp.logprob);
    text += o.text;
    if (!o.text.empty() && !print_ids) {
      std::fwrite(o.text.data(), 1, o.text.size(), stdout);
      std::fflush(stdout);
    }
    if (o.finish != serve::FinishReason::none) finish = serve::finish_reason_name(o.finish);
  });
  engine.run_until_idle();
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!error.empty()) throw std::runtime_error(error);
  if (print_ids) {
    const nlohmann::json out = {{"prompt_ids", prompt_ids}, {"ids", ids},     {"logprobs", logprobs},
                                {"text", text},             {"finish_reason", finish}};
    fmt::print("{}\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("\n");
  }
  fmt::print(stderr, "[{} tokens, finish {}, first token {:.3f} s, {:.1f} tokens/s]\n", generated, finish,
             first_token_s, total > 0 ? double(generated) / total : 0.0);
  return 0;
}

int cmd_score(const Args& args) {
  std::string model_path, device = "cpu", dtype, prompt, completion;
  bool have_prompt = false, have_completion = false, chat_template = true;
  Flags flags("score", kScoreUsage);
  ModelNeeds needs;
  add_common_flags(flags, model_path, prompt, have_prompt, chat_template, device, dtype, needs);
  flags.value("--completion", [&](const std::string& v) {
    completion = v;
    have_completion = true;
  });
  if (auto rc = flags.parse(args)) return *rc;
  if (!have_prompt || !have_completion) {
    fmt::print(stderr, "areno score: --prompt and --completion are required\n\n{}", kScoreUsage);
    return 2;
  }
  ServedModel m = load_served_model(model_path, device, dtype, needs);
  const std::vector<int64_t> pids = make_prompt(m, "", prompt, chat_template).ids;
  std::vector<int64_t> cids;
  for (tok::TokenId id : m.tokenizer->encode(completion)) cids.push_back(id);
  if (cids.empty()) throw std::invalid_argument("--completion: the completion is empty");
  const std::vector<float> lps = phi4mm::score(*m.model, pids, cids);
  nlohmann::json tokens = nlohmann::json::array();
  double sum = 0;
  for (size_t i = 0; i < cids.size(); ++i) {
    const tok::TokenId id = tok::TokenId(cids[i]);
    tokens.push_back({{"id", cids[i]},
                      {"token", m.tokenizer->decode(std::span<const tok::TokenId>(&id, 1))},
                      {"logprob", lps[i]}});
    sum += lps[i];
  }
  const nlohmann::json out = {{"model", m.name},
                              {"prompt_tokens", pids.size()},
                              {"completion_tokens", cids.size()},
                              {"tokens", tokens},
                              {"sum_logprob", sum}};
  fmt::print("{}\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  return 0;
}

}  // namespace areno::app
