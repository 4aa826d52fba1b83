// The order schema both grammar benchmarks use (bench/grammar_bench.cc compiles it,
// bench/structured_decode_bench.cc decodes under it).
#pragma once

namespace tandem::bench {

// An order of the kind an agent returns: strings, numbers, an enum, a nested object and an
// array of line items. Its strings and array are bounded: each bounded repetition unrolls into
// one grammar position per character or item, hundreds of byte-set positions.
inline constexpr char kOrderSchema[] = R"({
  "type": "object",
  "properties": {
    "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
    "customer": {"type": "object", "properties": {
      "name": {"type": "string", "maxLength": 40}, "email": {"type": "string", "maxLength": 60},
      "vip": {"type": "boolean"}}, "required": ["name", "email", "vip"],
      "additionalProperties": false},
    "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
    "items": {"type": "array", "minItems": 2, "maxItems": 8, "items": {"type": "object",
      "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"},
      "price": {"type": "number"}}, "required": ["sku", "qty", "price"],
      "additionalProperties": false}},
    "note": {"anyOf": [{"type": "string", "maxLength": 80}, {"type": "null"}]}
  },
  "required": ["order_id", "customer", "status", "items", "note"],
  "additionalProperties": false
})";

}  // namespace tandem::bench
