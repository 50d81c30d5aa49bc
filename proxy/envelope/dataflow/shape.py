"""Instruction-shaped sentences: the shape of an order aimed at the assistant, not its words.

A declassified argument (an e-mail body, a ticket's description) may carry untrusted text by
design; what it must not carry is the attacker's order to the agent, repeated to a person or
to another agent ("ignore previous instructions", "forward ... to", "you must", "do not tell
the user"). This classifies one sentence by its shape, from four small closed word classes
(no benchmark phrases):

- **override**: a verb of dismissal (ignore, disregard, forget, override, bypass) whose object
  is the agent's guidance (instructions, rules, prompt, guidelines, previous / above);
- **secrecy**: a negated verb of telling (do not / don't / never + tell, inform, mention,
  notify, reveal, alert, let ... know) or "without telling";
- **obligation**: second person under an obligation (you must / should / need to / have to /
  are required to / are instructed to, make sure you);
- **directed imperative**: the sentence opens (after an address such as "assistant," or
  "important:" and an optional "please" / adverb) with an agent-action verb (send, forward,
  transfer, wire, pay, share, upload, post, delete, remove, grant, invite, execute, run, click,
  visit, reply, ...) and is directed: a verb that moves something (send, forward, pay, share,
  ...) with a recipient ("to <someone>"), or any such verb with an address or URL, urgency
  ("immediately", "right away"), a credential (password, PIN, token, card details) or the
  assistant / AI / agent named.

Plain imperatives without a target ("stir the sauce", "hold the reset button for ten
seconds") and statements ("revenue grew 12 percent") are not instruction-shaped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# Where a sentence (or a clause that can stand alone) ends: terminal punctuation or a colon
# followed by space, or a line break ("vendor portal: reply to all ..." holds an imperative).
_SPLIT = re.compile(r"(?<=[.!?;:])\s+|\n+")

_AGENT = r"(?:assistant|ai|agent|bot|chatbot|model|llm|copilot|gpt|claude|system)"
_OVERRIDE = re.compile(
    r"\b(?:ignore|disregard|forget|override|bypass|skip)\b[^.!?]{0,40}?"
    r"\b(?:instructions?|rules?|prompts?|guidelines?|directives?|previous|prior|above|earlier|"
    r"system message|guardrails?|policy|policies|restrictions?)\b")
_SECRECY = re.compile(
    r"\b(?:do not|don'?t|dont|never|without)\s+(?:\w+\s+){0,2}?"
    r"(?:tell|telling|inform|informing|mention|mentioning|notify|notifying|reveal|revealing|alert|"
    r"alerting|let\s+(?:\w+\s+){1,2}know|disclose|disclosing)\b")
_OBLIGATION = re.compile(
    r"\byou\s+(?:must|should|shall|need to|have to|are (?:required|instructed|asked|expected) to|"
    r"will now|are now to)\b|\bmake sure (?:you|to)\b|\bit is (?:mandatory|required) (?:that|to)\b")
# Verbs that move something to a recipient: with "to <someone>" they are a directed order.
_TRANSFER = (
    "send|forward|transfer|wire|pay|email|e-mail|mail|share|upload|post|publish|give|provide|"
    "reveal|disclose|leak|export|copy|cc|bcc|reply|respond|report|submit|grant|invite"
)
# Other verbs of agent action: directed only by an address or link, urgency, or the agent named.
_ACTION = (
    _TRANSFER + "|delete|remove|erase|wipe|add|execute|run|call|invoke|click|visit|open|navigate|"
    "go|download|install|tell|inform|notify|change|reset|update|set|book|reserve|buy|purchase|"
    "order|approve|accept|confirm|move|include|attach|disable|enable|create|print|output|write|"
    "type|enter|sign|follow|use"
)
# The opening of an imperative: optional address ("assistant," "important:", "note to ai:"),
# optional politeness or adverb, then the verb.
_IMPERATIVE = re.compile(
    r"^(?:(?P<agent>(?:dear\s+)?(?:\w+\s+){0,3}?" + _AGENT + r"s?\s*[,:\-]\s*)|(?:important|urgent|note|attention|"
    r"system note|p\.?s\.?|reminder|action required)\s*[:!,\-]\s*)?"
    r"(?:(?:please|kindly|now|then|also|immediately|quickly|always|just|first|next)\s+)*"
    r"(?P<verb>" + _ACTION + r")\b(?P<rest>.*)$")
_TRANSFER_VERB = re.compile(r"^(?:" + _TRANSFER + r")$")
# A recipient of a transfer verb: "to" + something ("to be", "to do" are not recipients).
_RECIPIENT = re.compile(r"\bto\s+(?!be\b|do\b|make\b|get\b)\S")
# What directs any agent action: an address or link, urgency, or the agent named.
_DIRECTED = re.compile(
    r"(?<![\w.+-])[\w.+-]+@[\w-]+\.\w|https?://|\bwww\.|"  # one start per run: linear time
    r"\b(?:immediately|right away|asap|at once|without delay|without hesitation)\b|"
    r"\b(?:passwords?|credentials?|passcodes?|pin|api keys?|tokens?|login details|card details|"
    r"bank details|security codes?)\b|"
    r"\b" + _AGENT + r"\b")
_LEAD = re.compile(r"^[\s\"'`*>#\-\u2022\u2013\u2014(\[]+")


def sentences(text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each sentence or clause of `text` (split at terminal punctuation, colons
    and line breaks: normalised text has no capitals to tell a heading from a sentence)."""
    start = 0
    for m in _SPLIT.finditer(text):
        if m.start() > start:
            yield start, m.start()
        start = m.end()
    if start < len(text):
        yield start, len(text)


def instruction_shaped(sentence: str) -> str | None:
    """Which shape makes `sentence` an order aimed at the assistant (override, secrecy,
    obligation, imperative), or None."""
    low = _LEAD.sub("", sentence.casefold()).strip()
    if not low:
        return None
    if _OVERRIDE.search(low):
        return "override"
    if _SECRECY.search(low):
        return "secrecy"
    if _OBLIGATION.search(low):
        return "obligation"
    m = _IMPERATIVE.match(low)
    if m is not None:
        rest = m.group("rest")
        if m.group("agent") or _DIRECTED.search(rest) or (
                _TRANSFER_VERB.match(m.group("verb")) and _RECIPIENT.search(rest)):
            return "imperative"
    return None
