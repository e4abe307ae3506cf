"""JSON-schema keywords the converter enforces by generating a subset of the schema's language
(oneOf narrowing, dependencies, property counts, patternProperties, not, if/then/else, multipleOf,
fractional bounds, $id/anchor references): sampled outputs validate with jsonschema, and what
cannot be enforced is refused naming the keyword."""

from __future__ import annotations

import re

import pytest

from strand.constrained import GrammarCompileError, GrammarCompiler, TokenizerInfo
from strand.constrained.json_schema import JsonSchemaConverter
from tests.test_constrained_grammar import check_schema_walks


@pytest.fixture(scope="module")
def tok():
    from strand.runtime.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(TokenizerInfo.from_tokenizer(tok), timeout_s=60)


CLOSED_A = {"type": "object", "properties": {"key": {"type": "string", "maxLength": 4}}, "additionalProperties": False}
CLOSED_B = {"type": "object", "properties": {"keys": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
            "additionalProperties": False}
LOGIN = {"login": {"type": "string", "maxLength": 4}, "password": {"type": "string", "maxLength": 4}}
# (name, schema, instances the grammar must accept)
SCHEMAS = [
    # oneOf: an optional property another branch requires is forbidden
    ("one_of_required_keys", {"oneOf": [{"type": "object", "properties": LOGIN, "required": ["login"]},
                                        {"type": "object", "properties": LOGIN, "required": ["password"]}]},
     [{"login": "a"}, {"password": "b"}]),
    # oneOf: closed objects; each branch must generate a property the other does not declare
    ("one_of_closed_objects", {"oneOf": [CLOSED_A, CLOSED_B]}, [{"key": "x"}, {"keys": [True]}]),
    # oneOf: literals another branch accepts are dropped ("orange" and 6 are in both)
    ("one_of_literals", {"oneOf": [{"enum": ["red", "orange", 6]}, {"enum": ["blue", "orange", 6, 3]}]},
     ["red", "blue", 3]),
    ("one_of_ranges", {"oneOf": [{"type": "integer", "maximum": 0}, {"type": "integer", "minimum": 1}]}, [-3, 0, 7]),
    ("one_of_ref_discriminator", {"$defs": {"kind": {"type": "string", "enum": ["circle"]}},
                                  "oneOf": [{"type": "object", "properties": {"k": {"$ref": "#/$defs/kind"}, "r": {"type": "integer"}},
                                             "required": ["k", "r"]},
                                            {"type": "object", "properties": {"k": {"const": "square"}, "r": {"type": "integer"}},
                                             "required": ["k"]}]},
     [{"k": "circle", "r": 1}, {"k": "square"}]),
    ("one_of_pattern_prefixes", {"oneOf": [{"type": "string", "pattern": "^https?://[a-z]+$"},
                                           {"type": "string", "pattern": "^\\./[a-z]+$"}]}, ["http://x", "./y"]),
    ("all_of_one_of_product", {"allOf": [{"oneOf": [{"const": 1}, {"const": 2}]}, {"oneOf": [{"enum": [1, 3]}, {"enum": [2, 4]}]}]},
     [1, 2]),
    # dependencies: folded in when their property may be generated
    ("dependencies_optional", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                               "dependencies": {"a": ["b"]}}, [{"b": True}, {"a": 1, "b": False}]),
    ("dependent_schemas", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "dependentSchemas": {"a": {"properties": {"c": {"const": 1}}, "required": ["c"]}}},
     [{"a": 2, "c": 1}]),
    ("dependencies_free_object", {"type": "object", "dependencies": {"a": ["b"]}, "maxProperties": 2}, []),
    # property counts: optional properties become required / are left out, in declared order
    ("min_properties", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
                        "minProperties": 1}, [{"a": 1}, {"a": 1, "b": None}]),
    ("max_properties", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "null"},
                                                         "c": {"type": "boolean"}},
                        "required": ["c"], "maxProperties": 2}, [{"c": True}, {"a": 1, "c": False}]),
    # objects without declared properties
    ("pattern_properties", {"type": "object", "patternProperties": {"^x-[a-z]{1,4}$": {"type": "integer"}},
                            "additionalProperties": False, "maxProperties": 3}, [{}, {"x-ab": 3}]),
    ("pattern_properties_on_declared", {"type": "object", "properties": {"x-a": {"type": ["integer", "string"]}},
                                        "patternProperties": {"^x-": {"type": "integer", "minimum": 0}}, "required": ["x-a"]},
     [{"x-a": 4}]),
    ("property_names", {"type": "object", "propertyNames": {"enum": ["u", "v"]},
                        "additionalProperties": {"type": "boolean"}, "minProperties": 1}, [{"u": True}]),
    # not
    ("not_false_property", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"not": {}}}},
     [{}, {"a": 2}]),
    ("not_type", {"not": {"type": ["string", "object", "array"]}}, [None, True, 1.5]),
    ("not_required", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x"], "not": {"required": ["x", "y"]}}, [{"x": 1}]),
    ("not_excluded", {"type": "integer", "not": {"enum": ["a", "b"]}}, [4]),
    ("enum_not", {"enum": ["a", "b", "c"], "not": {"const": "b"}}, ["a", "c"]),
    # if/then/else
    ("if_then_else", {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
                      "required": ["kind"],
                      "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
                      "else": {"not": {"required": ["n"]}}}, [{"kind": "a", "n": 1}, {"kind": "b"}]),
    # numbers
    ("multiple_of_int", {"type": "integer", "multipleOf": 3}, [0, 9]),
    ("multiple_of_bounded", {"type": "integer", "multipleOf": 12, "minimum": 1}, [12, 24]),
    ("multiple_of_fraction", {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 1}, [0.5]),
    ("fractional_bounds", {"type": "number", "minimum": -459.67, "maximum": 10.5}, [-459, 10]),
    # references by anchor and by $id
    ("draft4_anchor_ref", {"$schema": "http://json-schema.org/draft-04/schema#",
                           "definitions": {"n": {"id": "#n", "type": "integer", "minimum": 0}},
                           "type": "array", "items": {"$ref": "#n"}, "maxItems": 2}, [[0, 5]]),
    ("id_uri_ref", {"$id": "https://example.com/root.json", "$defs": {"s": {"type": "string", "maxLength": 3}},
                    "type": "object", "properties": {"s": {"$ref": "https://example.com/root.json#/$defs/s"}},
                    "required": ["s"]}, [{"s": "ab"}]),
    # allOf: one branch's additionalProperties schema binds the other branch's properties
    ("all_of_additional_schema", {"allOf": [{"type": "object", "additionalProperties": {"type": "string", "maxLength": 3}},
                                            {"properties": {"a": {"type": ["string", "integer"]}}, "required": ["a"]}]},
     [{"a": "x"}]),
    # enum/const: JSON equality (true is not 1)
    ("const_enum_bool", {"const": True, "enum": [1, True]}, [True]),
]


@pytest.mark.parametrize("name,schema,valid", SCHEMAS, ids=[n for n, _, _ in SCHEMAS])
def test_enforced_keywords_walks_validate(compiler, tok, name, schema, valid):
    check_schema_walks(compiler, tok, schema, valid, seeds=4)


@pytest.mark.parametrize("schema,keyword", [
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}, "oneOf"),
    ({"type": "string", "not": {"pattern": "^a"}}, "not"),
    ({"type": "string", "pattern": "^a", "if": {"pattern": "^ab"}, "then": {"maxLength": 3}}, "if"),
    ({"type": "object", "minProperties": 2}, "minProperties"),
    ({"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 2}, "multipleOf"),
    ({"type": "number", "minimum": 0.2, "maximum": 0.8}, "minimum"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
    ({"$ref": "#missing"}, "anchor"),
    ({"$defs": {"a": {"$id": "https://other.example/a.json", "$ref": "#/$defs/b", "$defs": {"b": {}}}},
      "$ref": "#/$defs/a"}, "$id"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
])
def test_unenforceable_keywords_refused(schema, keyword):
    with pytest.raises(GrammarCompileError, match=re.escape(keyword)):
        JsonSchemaConverter("compact").convert(schema)


def test_unsatisfiable_one_of_is_refused_not_generated():
    # every branch's `not` contradicts the properties the object requires (a GlaiveAI pattern)
    schema = {"type": "object", "properties": {"r": {"type": "number"}, "w": {"type": "number"}},
              "required": ["r", "w"],
              "oneOf": [{"not": {"required": ["r"]}, "required": ["w"]}, {"not": {"required": ["w"]}, "required": ["r"]}]}
    with pytest.raises(GrammarCompileError, match="accepts no value"):
        JsonSchemaConverter("compact").convert(schema)


def test_recursive_all_of_ref_is_cut():
    schema = {"definitions": {"Foo": {"type": "object", "required": ["kid"],
                                      "properties": {"kid": {"allOf": [{"$ref": "#/definitions/Foo"}, {"type": "object"}]}}}},
              "$ref": "#/definitions/Foo"}
    with pytest.raises(GrammarCompileError, match="accepts no value"):
        JsonSchemaConverter("compact").convert(schema)


def test_const_enum_without_common_value_is_refused():
    with pytest.raises(GrammarCompileError, match="accepts no value"):
        JsonSchemaConverter("compact").convert({"const": 1, "enum": [True]})
