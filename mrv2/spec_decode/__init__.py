"""Speculative decoding: proposers of draft tokens and their acceptance statistics.

The target model verifies a request's drafts in the next step (`mrv2.sample.draft_verify`);
a proposer only says which tokens to try.
"""
