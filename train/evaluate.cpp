#include "train/evaluate.h"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "serve/engine.h"

namespace areno::train {

std::vector<AnswerCheck> greedy_exact_match(std::shared_ptr<phi4mm::Phi4MMForCausalLM> model,
                                            std::shared_ptr<const tok::Tokenizer> tokenizer,
                                            const std::vector<SftRow>& rows) {
  serve::EngineOptions eo;
  eo.eos_token_ids = model->config().generation.eos_token_ids;
  eo.kv_cache_bytes = size_t(256) << 20;
  eo.max_queue = std::max<int64_t>(eo.max_queue, int64_t(rows.size()));
  auto is_eos = [&](int64_t id) {
    return std::find(eo.eos_token_ids.begin(), eo.eos_token_ids.end(), id) != eo.eos_token_ids.end();
  };
  serve::Engine engine(std::move(model), std::move(tokenizer), eo);
  std::vector<AnswerCheck> out(rows.size());
  std::vector<std::string> errors(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const SftRow& row = rows[i];
    AnswerCheck& c = out[i];
    c.line = row.line;
    c.expected = first_answer_of(row);
    if (!c.expected.empty() && is_eos(c.expected.back())) c.expected.pop_back();
    serve::Request r;
    r.prompt = prompt_of(row);
    r.adapter = row.adapter;
    r.media = row.media;
    r.params.temperature = 0;
    r.params.max_tokens = int64_t(c.expected.size()) + 1;
    engine.submit(std::move(r), [&c, &err = errors[i], is_eos](const serve::RequestOutput& o) {
      if (!o.error.empty()) err = o.error;
      if (o.sample < 0) return;
      for (int64_t id : o.tokens) {
        if (is_eos(id)) c.finished = true;
        else if (!c.finished) c.generated.push_back(id);
      }
      if (o.finish == serve::FinishReason::stop) c.finished = true;
    });
  }
  engine.run_until_idle();
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!errors[i].empty()) throw std::runtime_error(fmt::format("row {}: {}", rows[i].line, errors[i]));
    out[i].correct = out[i].finished && out[i].generated == out[i].expected;
  }
  return out;
}

}  // namespace areno::train
