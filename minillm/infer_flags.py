"""The command line's flags read into settings and checked: each bad value one line, before the model loads.

`python -m minillm.infer` (`minillm.infer`) parses its flags; this turns them into a
`SamplingConfig`, beam-search and lookahead options, and refuses flags that only mean
something beside another flag, so a mistake costs a second, not a model load.
"""

from __future__ import annotations

from .base.cli_inputs import schema_text
from .compile import DEFAULT_VERIFY_TOKENS
from .decoding.sampling import SamplingConfig, SamplingError
from .parallel.command import check_sharded_flags


def sampling_config(args, eos_token_id=None) -> SamplingConfig:
    """The flags as a validated SamplingConfig; a bad value is reported under its flag's name.

    Sampling is on when --temperature > 0 is given, or when --top-k/--top-p/--min-p is set
    (at temperature 1), unless --greedy; a filter flag is never silently ignored.
    """
    filters_set = args.top_k != 0 or args.top_p != 1.0 or args.min_p != 0.0
    sampling = not args.greedy and (args.temperature > 0 if args.temperature is not None else filters_set)
    try:
        return SamplingConfig(
            max_new_tokens=args.max_new_tokens, do_sample=sampling,
            temperature=args.temperature if args.temperature is not None else 1.0,
            top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            eos_token_id=eos_token_id, stop=tuple(args.stop), seed=args.seed,
            json_schema=schema_text(args.json_schema), regex=args.regex, logit_bias=logit_bias(args.logit_bias),
        )
    except SamplingError as e:
        raise ValueError(f"--{e.field.replace('_', '-')} {e.value!r} is invalid: must be {e.allowed}") from None


def logit_bias(pairs: list[str]) -> dict[int, float]:
    """--logit-bias 2=-100 --logit-bias 42=5.5 -> {2: -100.0, 42: 5.5}."""
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias {pair!r} is invalid: write ID=VALUE, a token id and a number, "
                             "e.g. --logit-bias 2=-100") from None
    return bias


def check_constraint(args, config: SamplingConfig) -> None:
    """--json-schema / --regex go with plain generation only, and are turned into their automaton once before
    the model loads, so a schema keyword or a pattern outside lesson 18's subset is one line naming it."""
    from .decoding.structured import constraint_dfa

    if config.constraint is None:
        return
    kind, source = config.constraint
    flag = f"--{kind.replace('_', '-')}"
    if args.speculative or args.num_beams > 1:
        raise ValueError(f"{flag} masks each token as plain generation picks it; speculative decoding and beam "
                         "search do not apply the mask: drop --speculative / --num-beams, or the constraint")
    try:
        constraint_dfa(kind, source)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def beam_options(args, config: SamplingConfig) -> dict | None:
    """The beam-search flags, checked before the model load; None without --num-beams > 1 (then
    --num-return-sequences K > 1 asks for K samples per prompt: `samples_per_prompt`)."""
    from .strategies.beam import check_beam_options

    given = [flag for flag, value in (("--length-penalty", args.length_penalty),
                                      ("--early-stopping", args.early_stopping)) if value is not None]
    if args.num_beams == 1:
        if given:
            raise ValueError(f"{given[0]} applies to beam search only: add --num-beams N with N > 1")
        samples_per_prompt(args, config)
        return None
    early = {None: "false", "true": "true", "false": "false", "never": "never"}.get(
        args.early_stopping and args.early_stopping.lower())
    if early is None:
        raise ValueError(f"--early-stopping {args.early_stopping!r} is invalid: use true, false or never")
    if getattr(args, "speculative", None):
        raise ValueError("--num-beams cannot be combined with --speculative: choose one")
    options = dict(num_beams=args.num_beams, num_return_sequences=args.num_return_sequences,
                   length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                   early_stopping={"true": True, "false": False, "never": "never"}[early])
    check_beam_options(config, **options)
    return options


def samples_per_prompt(args, config: SamplingConfig) -> int:
    """Without beams, --num-return-sequences K draws K answers per prompt (seeds seed, seed + 1, ..., as the server's
    n choices): refused where they could only be alike or where the strategy runs one row."""
    k = args.num_return_sequences
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--num-return-sequences {k} is invalid: must be an integer >= 1")
    if k > 1 and not config.do_sample:
        raise ValueError(f"--num-return-sequences {k} without --num-beams draws {k} samples, but decoding is greedy "
                         f"(all {k} would be the same): add --temperature > 0, or --num-beams N >= {k}")
    if k > 1 and getattr(args, "speculative", None):
        raise ValueError("--num-return-sequences with --speculative: speculative decoding runs one row; choose one")
    return k


def lookahead_options(args) -> dict:
    """--decoding-length / --branch-length as Lookahead's keywords: the decoding length the kept verify graph
    holds unless given, Lookahead's default branch length unless given."""
    length = DEFAULT_VERIFY_TOKENS - 1 if args.decoding_length is None else args.decoding_length
    given = {"decoding_length": length, "branch_length": args.branch_length}
    return {name: value for name, value in given.items() if value is not None}


def check_flag_combinations(args) -> None:
    """Flags that only mean something with another flag are refused without it, never ignored."""
    from .strategies.lookahead import check_lookahead_lengths
    from .strategies.speculative import check_num_draft_tokens

    lookahead_flags = (("--decoding-length", args.decoding_length), ("--branch-length", args.branch_length))
    if not args.speculative:
        for flag, value in (("--draft-model", args.draft_model), ("--num-draft-tokens", args.num_draft_tokens),
                            *lookahead_flags):
            if value is not None:
                raise ValueError(f"{flag} applies to speculative decoding only: add --speculative")
    elif args.speculative == "lookahead":
        if args.num_draft_tokens is not None:
            raise ValueError("--num-draft-tokens is for model and prompt-lookup drafts: lookahead's budget is "
                             "--decoding-length")
        check_lookahead_lengths(**lookahead_options(args), as_flags=True)
    else:
        for flag, value in lookahead_flags:
            if value is not None:
                raise ValueError(f"{flag} applies to --speculative lookahead only")
        if args.num_draft_tokens is not None:
            check_num_draft_tokens(args.num_draft_tokens, "--num-draft-tokens")
    if args.compile and args.attention != "sdpa":
        raise ValueError(f"--attention {args.attention} picks an eager kernel, and a compiled graph writes its own "
                         "attention (lesson 15): drop --compile or --attention")
    if args.compile and (args.num_beams > 1 or args.cache != "static"):
        raise ValueError("--compile applies to plain and speculative generation over the static cache: drop "
                         "--num-beams or --cache")
    if args.slide and (args.speculative or args.num_beams > 1):
        raise ValueError("--slide applies to plain generation: speculative decoding and beam search never slide the "
                         "window; drop --slide, or --speculative / --num-beams")
    check_sharded_flags(args.tp, args.compile, args.quant)
    if args.system is not None and args.chat is False:
        raise ValueError("--system goes into the chat template, which --no-chat turns off: drop one of them")


__all__ = ["beam_options", "check_constraint", "check_flag_combinations", "logit_bias", "lookahead_options",
           "sampling_config"]
