// Random JSON schemas of the structured-outputs subset, seeded, for the node API tests
// (structured outputs, tool parameters).

// mulberry32: a small seeded generator, so the schemas are the same on every run.
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Random schemas of the structured-outputs subset (after grammar/src/testing/schema_fuzz.h):
// objects with required properties and no others, arrays, enums, const, anyOf, nullable types,
// patterns, nested objects and $ref into $defs; every document bounded.
export class SchemaGenerator {
  constructor(seed) {
    this.random = rng(seed);
  }
  int(lo, hi) {
    return lo + Math.floor(this.random() * (hi - lo + 1));
  }
  coin(p = 0.5) {
    return this.random() < p;
  }
  pick(list) {
    return list[this.int(0, list.length - 1)];
  }
  string() {
    const min = this.int(0, 2);
    return { type: 'string', minLength: min, maxLength: min + this.int(0, 6) };
  }
  object(depth) {
    const properties = {};
    const required = [];
    const n = this.int(depth === 0 ? 1 : 0, 3);
    for (let i = 0; i < n; i++) {
      const key = this.coin(0.85) ? `k${i}` : `k"é${i}`;
      properties[key] = this.sub(depth + 1);
      if (this.coin(0.6)) required.push(key);
    }
    return { type: 'object', properties, required, additionalProperties: false };
  }
  sub(depth) {
    switch (this.int(0, depth >= 2 ? 8 : 12)) {
      case 0: return this.string();
      case 1: return { type: 'integer' };
      case 2: return { type: 'number' };
      case 3: return { type: 'boolean' };
      case 4: return { type: 'null' };
      case 5: return { enum: this.pick([['red', 'gr"een', 3, null, true], ['a', 'b'], [1.5, -2, 'x y']]) };
      case 6: return { const: this.pick(['fixed', 42, false, null]) };
      case 7: return { type: ['string', 'null'], maxLength: this.int(0, 5) };
      case 8: return { type: 'string', pattern: this.pick(['^[a-z]{1,4}$', '^[0-9]{3}-[A-Z]{2}$', '^(yes|no)$']) };
      case 9:
      case 10: return this.object(depth);
      case 11: {
        const max = this.int(0, 3);
        const a = { type: 'array', items: this.sub(depth + 1), maxItems: max };
        if (this.coin()) a.minItems = this.int(0, max);
        return a;
      }
      default: return { anyOf: [this.sub(depth + 1), this.sub(depth + 1)] };
    }
  }
  schema() {
    let s = this.object(0);
    if (this.coin(0.3)) {
      s = {
        type: 'object',
        properties: { main: s, extra: { $ref: '#/$defs/item' }, more: { type: 'array', items: { $ref: '#/$defs/item' }, maxItems: 2 } },
        required: ['main', 'extra'],
        additionalProperties: false,
        $defs: { item: this.object(1) },
      };
    }
    return s;
  }
}
