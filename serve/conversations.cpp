#include "serve/conversations.h"

#include <fmt/format.h>

namespace areno::serve {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

ApiError bad(const std::string& param, const std::string& why) {
  return ApiError(400, fmt::format("'{}' {}", param, why), param);
}

void check_body(const ojson& body, std::initializer_list<const char*> known) {
  if (!body.is_object())
    throw ApiError(400, fmt::format("the request body must be a JSON object (got {})", body.type_name()));
  for (auto it = body.begin(); it != body.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok |= it.key() == k;
    if (!ok) throw bad(it.key(), "is not a field of this request");
  }
}

// Up to kMaxConversationItemsAdded valid input items, in the stored shape.
ojson items_to_add(const ojson& items, bool required) {
  if (!items.is_array()) throw bad("items", "must be an array of input items");
  if (required && items.empty()) throw bad("items", "must not be empty");
  if (items.size() > kMaxConversationItemsAdded)
    throw bad("items", fmt::format("has {} items: at most {} are added at once", items.size(),
                                   kMaxConversationItemsAdded));
  check_input_items(items, "items");
  ojson out = ojson::array();
  for (const ojson& item : items) out.push_back(stored_item(item));
  return out;
}

}  // namespace

bool is_conversation(const ResponsesStore::Entry& e) {
  return e.object.is_object() && e.object.value("object", "") == "conversation";
}

std::pair<json, ojson> parse_new_conversation(const ojson& body, int64_t now) {
  check_body(body, {"items", "metadata", "safety_identifier"});
  if (body.contains("safety_identifier") && !body["safety_identifier"].is_null() &&
      !body["safety_identifier"].is_string())
    throw bad("safety_identifier", "must be a string");  // (kept nowhere, as in responses)
  ojson items = body.contains("items") && !body["items"].is_null() ? items_to_add(body["items"], false) : ojson::array();
  json metadata = body.contains("metadata") ? check_metadata(body["metadata"], "metadata") : json::object();
  json object = {{"id", new_response_id("conv_")},
                 {"object", "conversation"},
                 {"created_at", now},
                 {"metadata", std::move(metadata)}};
  return {std::move(object), std::move(items)};
}

json parse_conversation_update(const ojson& body) {
  check_body(body, {"metadata"});
  if (!body.contains("metadata")) throw bad("metadata", "is required");
  return check_metadata(body["metadata"], "metadata");
}

ojson parse_conversation_items(const ojson& body) {
  check_body(body, {"items"});
  if (!body.contains("items")) throw bad("items", "is required");
  return items_to_add(body["items"], true);
}

json item_list(const ojson& items) {
  json data = json::parse(items.dump());
  return {{"object", "list"},
          {"data", data},
          {"first_id", data.empty() ? json(nullptr) : data.front()["id"]},
          {"last_id", data.empty() ? json(nullptr) : data.back()["id"]},
          {"has_more", false}};
}

int64_t find_item(const ojson& items, const std::string& id) {
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].is_object() && items[i].contains("id") && items[i]["id"] == id) return int64_t(i);
  return -1;
}

}  // namespace areno::serve
