#pragma once
// OpenAI's Conversations API, kept in the ResponsesStore beside the stored
// responses (one memory budget, `serve --responses-store-mb`, least recently
// used out, nothing kept across a restart). A conversation is an entry whose
// object is {"id": "conv_" and 32 hex digits, "object": "conversation",
// "created_at", "metadata"} and whose conversation is its items, all of them
// counted as input (Entry::inputs), in stored_item's shape with ids.
// Independent of HTTP (serve/http_server.cpp routes it):
//
//   POST   /v1/conversations                    {"items": up to 20 input items, "metadata"}, both optional
//   GET    /v1/conversations/{id}               the object
//   POST   /v1/conversations/{id}               {"metadata"}: replaced
//   DELETE /v1/conversations/{id}               {"id", "object": "conversation.deleted", "deleted": true}
//   GET    /v1/conversations/{id}/items         limit, order (default desc), after: input_items_page
//   POST   /v1/conversations/{id}/items         {"items": 1 to 20}: the list of the items added
//   GET    /v1/conversations/{id}/items/{item}  the item
//   DELETE /v1/conversations/{id}/items/{item}  the conversation object
//
// A response given "conversation" (serve/responses.h) reads the items first,
// and once it completes (or is incomplete) its input and output items are
// added; a failed or cancelled one adds nothing.
#include <cstdint>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "serve/responses.h"

namespace areno::serve {

// Items added at once (OpenAI's limit), at creation or by POST .../items.
constexpr size_t kMaxConversationItemsAdded = 20;

bool is_conversation(const ResponsesStore::Entry& e);

// POST /v1/conversations: the new conversation's object (a fresh id, created
// at `now`) and its items. 400 naming the field.
std::pair<nlohmann::json, nlohmann::ordered_json> parse_new_conversation(const nlohmann::ordered_json& body,
                                                                         int64_t now);
// POST /v1/conversations/{id}: the metadata that replaces the old (null: none).
nlohmann::json parse_conversation_update(const nlohmann::ordered_json& body);
// POST /v1/conversations/{id}/items: the items to add (1 to 20).
nlohmann::ordered_json parse_conversation_items(const nlohmann::ordered_json& body);

// A list object of items just added: all of them, has_more false.
nlohmann::json item_list(const nlohmann::ordered_json& items);

// The index of the item whose id is `id`, or -1.
int64_t find_item(const nlohmann::ordered_json& items, const std::string& id);

}  // namespace areno::serve
