"""Tandem operator: reconciles DisaggregatedModel resources."""
