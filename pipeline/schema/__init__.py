"""pipeline/schema"""
