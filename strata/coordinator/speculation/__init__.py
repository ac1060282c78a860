"""Speculation on the coordinator: the drafts a decode window verifies and what it keeps
(speculation.py), how many drafts a group's slots get (draft_choice.py), the lookup drafter
and the draft counts (drafts.py).
May import: coordinator, protocol"""
